//! Builds header-only GGUF files for tests: real metadata, no tensor data, optionally a sparse
//! tail so a "4 TiB" model costs no disk.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

use crate::header::TensorInfo;
use crate::reader::MAGIC;
use crate::value::{Array, Value, ValueType};

/// A GGUF file to write: version 3 unless told otherwise, metadata in insertion order, tensor
/// infos, and an optional total size reached by extending the file sparsely.
///
/// ```
/// let bytes = gguf::writer::Builder::new()
///     .kv("general.architecture", "qwen3")
///     .kv("qwen3.block_count", 28u32)
///     .tensor("token_embd.weight", &[1024, 151936], 1, 0)
///     .to_bytes();
/// let h = gguf::read_header_from(&bytes[..], bytes.len() as u64, "fixture").unwrap();
/// assert_eq!(h.architecture(), Some("qwen3"));
/// ```
#[derive(Clone, Debug)]
pub struct Builder {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    total_size: Option<u64>,
}

impl Default for Builder {
    fn default() -> Self {
        Builder::new()
    }
}

impl Builder {
    /// A llama-architecture header with SmolLM2-135M's shape (30 layers, 576 wide, 9 heads,
    /// 3 KV heads, 8192 context) and no tensors: what the memory check needs to estimate a
    /// model, for fixtures such as a sparse 4 TiB file (`.total_size(4 << 40)`).
    pub fn smollm2_shaped() -> Builder {
        Builder::new()
            .kv("general.architecture", "llama")
            .kv("llama.block_count", 30u32)
            .kv("llama.context_length", 8192u32)
            .kv("llama.embedding_length", 576u32)
            .kv("llama.attention.head_count", 9u32)
            .kv("llama.attention.head_count_kv", 3u32)
    }

    pub fn new() -> Builder {
        Builder {
            version: 3,
            metadata: Vec::new(),
            tensors: Vec::new(),
            total_size: None,
        }
    }

    /// Writes this version number instead of 3 (to test refusals of v1 or v4).
    pub fn version(mut self, version: u32) -> Builder {
        self.version = version;
        self
    }

    /// Adds a key/value pair. Duplicates are written as given (to test their refusal).
    pub fn kv(mut self, key: impl Into<String>, value: impl Into<Value>) -> Builder {
        self.metadata.push((key.into(), value.into()));
        self
    }

    /// Adds a tensor info; `offset` is relative to the data section.
    pub fn tensor(
        mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: u32,
        offset: u64,
    ) -> Builder {
        self.tensors.push(TensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            offset,
        });
        self
    }

    /// Makes the written file this long, by a sparse extension past the header. A size
    /// smaller than the header leaves the header whole.
    pub fn total_size(mut self, bytes: u64) -> Builder {
        self.total_size = Some(bytes);
        self
    }

    /// The header bytes, padded to the alignment when there are tensors (as a converter would).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        put_u32(&mut out, self.version);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(&mut out, self.metadata.len() as u64);
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            put_u32(&mut out, value.value_type().code());
            put_value(&mut out, value);
        }
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            put_u32(&mut out, t.dims.len() as u32);
            for &d in &t.dims {
                put_u64(&mut out, d);
            }
            put_u32(&mut out, t.ggml_type);
            put_u64(&mut out, t.offset);
        }
        if !self.tensors.is_empty() {
            let alignment = self
                .metadata
                .iter()
                .find(|(k, _)| k == "general.alignment")
                .and_then(|(_, v)| v.as_u64())
                .filter(|a| a.is_power_of_two())
                .unwrap_or(crate::reader::DEFAULT_ALIGNMENT);
            let padded = (out.len() as u64).div_ceil(alignment) * alignment;
            out.resize(padded as usize, 0);
        }
        out
    }

    /// Writes the file (replacing any), then extends it sparsely to the total size if one was set.
    pub fn write(&self, path: &Path) -> io::Result<()> {
        let bytes = self.to_bytes();
        let mut file = File::create(path)?;
        file.write_all(&bytes)?;
        if let Some(total) = self.total_size
            && total > bytes.len() as u64
        {
            // set_len past the end leaves a hole: no blocks are written.
            file.set_len(total)?;
        }
        file.sync_all()
    }
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_str(out, s),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    put_u32(out, a.elem_type().code());
    put_u64(out, a.len() as u64);
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => each!(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => {
            for s in v {
                put_str(out, s);
            }
        }
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
        // A lean read kept only the shape: written back as that many zero values (empty
        // strings), so the header's layout and counts stay what they were.
        Array::Skipped { elem, len } => {
            for _ in 0..*len {
                match elem {
                    ValueType::String => put_str(out, ""),
                    other => out.extend(std::iter::repeat_n(0u8, other.min_size() as usize)),
                }
            }
        }
    }
}
