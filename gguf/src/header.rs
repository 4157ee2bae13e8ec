//! What a GGUF header holds once read, and typed lookups into its metadata.

use std::collections::HashMap;

use crate::error::{Error, ErrorKind};
use crate::value::{Array, Value};

/// The metadata key/value pairs, in file order, with lookup by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Adds a pair; returns false, changing nothing, when the key is already there
    /// (GGUF forbids duplicate keys).
    pub fn insert(&mut self, key: String, value: Value) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        true
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The pairs in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// One tensor's entry in the header; its data is never read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// `ne[]`, fastest-varying first; its length is the tensor's `n_dims`.
    pub dims: Vec<u64>,
    /// The `ggml_type` code (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 30 BF16, ...).
    pub ggml_type: u32,
    /// Offset of the data from `Header::data_offset`.
    pub offset: u64,
}

/// A GGUF file's header: everything before the tensor data.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// The file as the caller named it; errors from the lookups below carry it.
    pub source: String,
    pub version: u32,
    pub tensor_count: u64,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    /// `general.alignment`, 32 when absent.
    pub alignment: u64,
    /// Where the tensor data starts in the file.
    pub data_offset: u64,
}

impl Header {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A string value; `None` when absent or not a string.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// An integer value of any width or signedness, when not negative; `None` when absent
    /// or not an integer.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    /// A float, or an integer as a float; `None` when absent or not a number.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    pub fn get_array(&self, key: &str) -> Option<&Array> {
        self.get(key).and_then(Value::as_array)
    }

    /// `general.architecture`, the prefix of the model's own keys (`llama`, `qwen3`, ...).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// `{arch}.{suffix}` for this model's architecture, e.g. `arch_key("block_count")`.
    pub fn arch_key(&self, suffix: &str) -> Option<String> {
        self.architecture().map(|a| format!("{a}.{suffix}"))
    }

    /// An integer key that must be an integer when present: `Ok(None)` when absent, an
    /// error naming the key and its type when it holds something else.
    pub fn u64_checked(&self, key: &str) -> Result<Option<u64>, Error> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                self.metadata_error(
                    key,
                    format!("is a {}, expected a non-negative integer", v.value_type()),
                )
            }),
        }
    }

    /// A "scalar or per-layer array" key, as llama.cpp's `get_key_or_arr` reads it: a scalar
    /// applies to every layer; an array (of integers or bools) must have exactly `n_layer`
    /// elements. `Ok(None)` when the key is absent.
    ///
    /// `{arch}.attention.head_count_kv` is u32 in most models and an i32 array where some
    /// layers are recurrent (0 heads) or use fewer heads.
    pub fn per_layer(&self, key: &str, n_layer: usize) -> Result<Option<Vec<u64>>, Error> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        if let Some(v) = value.as_u64() {
            return Ok(Some(vec![v; n_layer]));
        }
        if let Some(v) = value.as_bool() {
            return Ok(Some(vec![u64::from(v); n_layer]));
        }
        let Some(array) = value.as_array() else {
            return Err(self.metadata_error(
                key,
                format!(
                    "is a {}, expected an integer or a per-layer array",
                    value.value_type()
                ),
            ));
        };
        let Some(values) = array.to_u64s() else {
            return Err(self.metadata_error(
                key,
                format!(
                    "is an array of {}, expected non-negative integers or bools",
                    array.elem_type()
                ),
            ));
        };
        if values.len() != n_layer {
            return Err(self.metadata_error(
                key,
                format!(
                    "has {} elements but the model has {n_layer} layers",
                    values.len()
                ),
            ));
        }
        Ok(Some(values))
    }

    /// An error about one metadata key of this file, for callers interpreting the header.
    pub fn metadata_error(&self, key: &str, problem: impl AsRef<str>) -> Error {
        Error::new(
            self.source.clone(),
            None,
            ErrorKind::Metadata,
            format!("key '{key}' {}", problem.as_ref()),
        )
    }

    /// A required key this file lacks: `key '<key>' is missing; <then>`, where `then` says
    /// what that means or what to pass instead.
    pub(crate) fn missing_key(&self, key: &str, then: &str) -> Error {
        Error::new(
            self.source.clone(),
            None,
            ErrorKind::MissingKey,
            format!("key '{key}' is missing; {then}"),
        )
    }
}
