//! Parses a GGUF header from a byte stream, refusing anything the remaining bytes cannot hold.

use std::io::{self, BufRead, Read};

use crate::error::{Error, ErrorKind};
use crate::header::{Header, Metadata, TensorInfo};
use crate::value::{Array, Value, ValueType};

/// "GGUF" as it appears in the first four bytes.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// ggml's `GGML_MAX_DIMS`: llama.cpp refuses tensors with more dimensions.
const MAX_DIMS: u32 = 4;
/// ggml's `GGML_MAX_NAME`: llama.cpp refuses tensor names this long or longer.
const MAX_TENSOR_NAME: u64 = 64;
/// `GGUF_DEFAULT_ALIGNMENT`.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// The smallest key/value pair: key length + a 1-byte key + type + a 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// The smallest tensor info: name length + n_dims + ggml type + offset.
const MIN_TENSOR_BYTES: u64 = 8 + 4 + 4 + 8;
/// Cap on any up-front reservation: honest files grow past it cheaply, and a caller who
/// overstates the stream length cannot make one claimed count allocate much.
const MAX_RESERVE: usize = 1 << 16;

/// A reader that knows where it is and how much of the file is left.
struct Cursor<'n, R> {
    inner: R,
    pos: u64,
    len: u64,
    name: &'n str,
    /// Arrays longer than this are skipped (their bytes walked, not kept); None keeps all.
    keep_arrays_up_to: Option<u64>,
}

impl<R: BufRead> Cursor<'_, R> {
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn err(&self, at: u64, kind: ErrorKind, message: impl Into<String>) -> Error {
        Error::new(self.name, Some(at), kind, message)
    }

    /// What a claim the rest of the file cannot hold says about the file: a claim larger
    /// than the whole file is corruption; a smaller one may just be a cut-off download.
    fn damage(&self, need: u64) -> &'static str {
        if need > self.len {
            "the file is corrupt"
        } else {
            "the file is incomplete or corrupt, download it again"
        }
    }

    fn truncated(&self, need: u64, what: &str) -> Error {
        self.err(
            self.pos,
            ErrorKind::Truncated,
            format!(
                "file ends inside {what} (needs {need} bytes, {} left); the file is incomplete, download it again",
                self.remaining()
            ),
        )
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], Error> {
        let mut buf = [0u8; N];
        self.fill(&mut buf, what)?;
        Ok(buf)
    }

    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<(), Error> {
        let need = buf.len() as u64;
        if need > self.remaining() {
            return Err(self.truncated(need, what));
        }
        match self.inner.read_exact(buf) {
            Ok(()) => {
                self.pos += need;
                Ok(())
            }
            // The stated length was more than the stream held.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(self.truncated(need, what)),
            Err(e) => Err(Error::io(self.name, &format!("byte {}: read", self.pos), e)),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32, Error> {
        self.bytes(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, Error> {
        self.bytes(what).map(u64::from_le_bytes)
    }

    fn i64(&mut self, what: &str) -> Result<i64, Error> {
        self.bytes(what).map(i64::from_le_bytes)
    }

    /// A string's length prefix, refused when the rest of the file cannot hold it.
    fn string_len(&mut self, what: &str) -> Result<u64, Error> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(self.err(
                at,
                ErrorKind::StringTooLong,
                format!(
                    "{what}: string of {len} bytes but only {} bytes remain in the file; {}",
                    self.remaining(),
                    self.damage(len)
                ),
            ));
        }
        Ok(len)
    }

    /// A length-prefixed string. Invalid UTF-8 is replaced, not refused: some tokenizer
    /// vocabularies carry raw bytes, and llama.cpp loads them.
    fn string(&mut self, what: &str) -> Result<String, Error> {
        let len = self.string_len(what)?;
        // Grown as bytes arrive rather than reserved from the claim, so a caller who
        // overstates the stream length cannot make a claimed length allocate.
        let mut buf = Vec::with_capacity((len as usize).min(MAX_RESERVE));
        let got = (&mut self.inner)
            .take(len)
            .read_to_end(&mut buf)
            .map_err(|e| Error::io(self.name, &format!("byte {}: read", self.pos), e))?;
        if (got as u64) < len {
            self.pos += got as u64;
            return Err(self.truncated(len - got as u64, what));
        }
        self.pos += len;
        Ok(match String::from_utf8(buf) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// Refuses `count` items of at least `min_size` bytes each when the rest of the file
    /// cannot hold them, so no claimed count drives an allocation or a long loop.
    fn check_count(&self, at: u64, count: u64, min_size: u64, what: &str) -> Result<(), Error> {
        let need = count.saturating_mul(min_size);
        if need <= self.remaining() {
            Ok(())
        } else {
            Err(self.err(
                at,
                ErrorKind::AbsurdCount,
                format!(
                    "header claims {count} {what} but only {} bytes remain; {}",
                    self.remaining(),
                    self.damage(need)
                ),
            ))
        }
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType, Error> {
        let at = self.pos;
        let code = self.u32(what)?;
        ValueType::from_code(code).ok_or_else(|| {
            self.err(
                at,
                ErrorKind::UnknownValueType,
                format!("{what}: unknown value type {code} (GGUF defines 0 to 12); the file is corrupt or from a newer format"),
            )
        })
    }

    fn value(&mut self, ty: ValueType, what: &str) -> Result<Value, Error> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.bytes(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.bytes(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.bytes(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.bytes(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.bytes(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.bytes(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.bytes(what)?)),
            ValueType::Bool => Value::Bool(self.bytes::<1>(what)?[0] != 0),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.bytes(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.bytes(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.bytes(what)?)),
            ValueType::Array => Value::Array(self.array(what)?),
        })
    }

    /// Walk past `n` bytes without keeping them.
    fn skip(&mut self, n: u64, what: &str) -> Result<(), Error> {
        if n > self.remaining() {
            return Err(self.truncated(n, what));
        }
        // Straight through the reader's own buffer: no copy, no allocation.
        let mut left = n;
        while left > 0 {
            let available = match self.inner.fill_buf() {
                Ok(buf) => buf.len() as u64,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(Error::io(self.name, &format!("byte {}: read", self.pos), e));
                }
            };
            if available == 0 {
                return Err(self.truncated(left, what));
            }
            let step = available.min(left);
            self.inner.consume(step as usize);
            self.pos += step;
            left -= step;
        }
        Ok(())
    }

    /// Walk past `n` elements of an array, checking each string's length as `string` does.
    fn skip_elements(&mut self, elem: ValueType, n: u64, what: &str) -> Result<(), Error> {
        if elem == ValueType::String {
            for _ in 0..n {
                // Fast path: the length and the string both sit in the reader's buffer.
                if let Ok(buf) = self.inner.fill_buf()
                    && buf.len() >= 8
                {
                    let len = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                    let whole = 8u64.saturating_add(len);
                    if whole <= buf.len() as u64 && whole <= self.remaining() {
                        self.inner.consume(whole as usize);
                        self.pos += whole;
                        continue;
                    }
                }
                let len = self.string_len(what)?;
                self.skip(len, what)?;
            }
            Ok(())
        } else {
            // check_count has bounded n * size by the remaining bytes.
            self.skip(n * elem.min_size(), what)
        }
    }

    /// An array value. Arrays of arrays are refused outright, so reading never recurses.
    fn array(&mut self, what: &str) -> Result<Array, Error> {
        let at = self.pos;
        let elem = self.value_type(what)?;
        if elem == ValueType::Array {
            return Err(self.err(
                at,
                ErrorKind::NestedArray,
                format!("{what}: array of arrays; nested arrays are not supported (llama.cpp refuses them too)"),
            ));
        }
        let count_at = self.pos;
        let count = self.u64(what)?;
        self.check_count(
            count_at,
            count,
            elem.min_size(),
            &format!("elements in {what}"),
        )?;
        if self.keep_arrays_up_to.is_some_and(|max| count > max) {
            self.skip_elements(elem, count, what)?;
            return Ok(Array::Skipped { elem, len: count });
        }
        // Fits in usize: count * min_size <= remaining bytes of a file we are reading.
        let n = count as usize;
        macro_rules! read_vec {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                for _ in 0..n {
                    v.push($read(self)?);
                }
                Array::$variant(v)
            }};
        }
        Ok(match elem {
            ValueType::U8 => read_vec!(U8, |c: &mut Self| c.bytes(what).map(u8::from_le_bytes)),
            ValueType::I8 => read_vec!(I8, |c: &mut Self| c.bytes(what).map(i8::from_le_bytes)),
            ValueType::U16 => read_vec!(U16, |c: &mut Self| c.bytes(what).map(u16::from_le_bytes)),
            ValueType::I16 => read_vec!(I16, |c: &mut Self| c.bytes(what).map(i16::from_le_bytes)),
            ValueType::U32 => read_vec!(U32, |c: &mut Self| c.bytes(what).map(u32::from_le_bytes)),
            ValueType::I32 => read_vec!(I32, |c: &mut Self| c.bytes(what).map(i32::from_le_bytes)),
            ValueType::F32 => read_vec!(F32, |c: &mut Self| c.bytes(what).map(f32::from_le_bytes)),
            ValueType::Bool => {
                read_vec!(Bool, |c: &mut Self| c.bytes::<1>(what).map(|b| b[0] != 0))
            }
            ValueType::String => read_vec!(String, |c: &mut Self| c.string(what)),
            ValueType::U64 => read_vec!(U64, |c: &mut Self| c.bytes(what).map(u64::from_le_bytes)),
            ValueType::I64 => read_vec!(I64, |c: &mut Self| c.bytes(what).map(i64::from_le_bytes)),
            ValueType::F64 => read_vec!(F64, |c: &mut Self| c.bytes(what).map(f64::from_le_bytes)),
            ValueType::Array => unreachable!("refused above"),
        })
    }

    fn tensor_info(&mut self, i: u64) -> Result<TensorInfo, Error> {
        let at = self.pos;
        let what = format!("tensor #{i}");
        let name = self.string(&format!("name of {what}"))?;
        if name.len() as u64 >= MAX_TENSOR_NAME {
            return Err(self.err(
                at,
                ErrorKind::Malformed,
                format!(
                    "{what}: name of {} bytes (llama.cpp allows at most {}); the file is corrupt",
                    name.len(),
                    MAX_TENSOR_NAME - 1
                ),
            ));
        }
        let what = format!("tensor '{name}'");
        let dims_at = self.pos;
        let n_dims = self.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(self.err(
                dims_at,
                ErrorKind::Malformed,
                format!("{what}: {n_dims} dimensions (ggml allows at most {MAX_DIMS}); the file is corrupt"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut elements: u64 = 1;
        for _ in 0..n_dims {
            let dim_at = self.pos;
            let d = self.i64(&what)?;
            let Ok(d) = u64::try_from(d) else {
                return Err(self.err(
                    dim_at,
                    ErrorKind::Malformed,
                    format!("{what}: negative dimension {d}; the file is corrupt"),
                ));
            };
            // llama.cpp requires the element count to fit an i64.
            elements = match elements.checked_mul(d) {
                Some(e) if e <= i64::MAX as u64 => e,
                _ => {
                    return Err(self.err(
                        dim_at,
                        ErrorKind::Malformed,
                        format!("{what}: element count overflows; the file is corrupt"),
                    ));
                }
            };
            dims.push(d);
        }
        let ggml_type = self.u32(&what)?;
        let offset = self.u64(&what)?;
        Ok(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        })
    }
}

/// Parses the header from `reader`, which yields the file from its first byte; `len` is the
/// file's size and bounds every count and allocation; `name` labels errors.
pub(crate) fn parse<R: BufRead>(
    reader: R,
    len: u64,
    name: &str,
    keep_arrays_up_to: Option<u64>,
) -> Result<Header, Error> {
    let mut c = Cursor {
        inner: reader,
        pos: 0,
        len,
        name,
        keep_arrays_up_to,
    };
    let version = preamble(&mut c)?;
    let (tensor_count, kv_count) = counts(&mut c)?;
    let metadata = metadata(&mut c, kv_count)?;
    let alignment = alignment(&metadata, name)?;
    let tensors = tensor_table(&mut c, tensor_count)?;

    // llama.cpp pads to the alignment only when there is tensor data to align.
    let data_offset = if tensor_count > 0 {
        c.pos.div_ceil(alignment).saturating_mul(alignment)
    } else {
        c.pos
    };

    Ok(Header {
        source: name.to_owned(),
        version,
        tensor_count,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// The magic and the version (2 or 3).
fn preamble<R: BufRead>(c: &mut Cursor<'_, R>) -> Result<u32, Error> {
    let len = c.len;
    if c.remaining() < 4 {
        return Err(c.err(
            0,
            ErrorKind::NotGguf,
            format!("not a GGUF file (only {len} bytes long); pass a .gguf model"),
        ));
    }
    let magic: [u8; 4] = c.bytes("the magic")?;
    if magic != MAGIC {
        let hex: String = magic.iter().map(|b| format!("{b:02x}")).collect();
        return Err(c.err(
            0,
            ErrorKind::NotGguf,
            format!("not a GGUF file (magic {hex}); pass a .gguf model"),
        ));
    }

    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(c.err(
                4,
                ErrorKind::UnsupportedVersion,
                "GGUF version 1 is not supported (only 2 and 3); convert the model again with a current llama.cpp",
            ));
        }
        v if v & 0xffff == 0 => {
            return Err(c.err(
                4,
                ErrorKind::UnsupportedVersion,
                format!("GGUF version {v:#010x} looks byte-swapped (a big-endian GGUF?); use a little-endian model"),
            ));
        }
        v => {
            return Err(c.err(
                4,
                ErrorKind::UnsupportedVersion,
                format!("GGUF version {v} is not supported (only 2 and 3); use a model converted for llama.cpp"),
            ));
        }
    }

    Ok(version)
}

/// The tensor and key/value counts, each checked against the bytes left.
fn counts<R: BufRead>(c: &mut Cursor<'_, R>) -> Result<(u64, u64), Error> {
    let tensor_count_at = c.pos;
    let tensor_count = c.i64("the tensor count")?;
    let kv_count_at = c.pos;
    let kv_count = c.i64("the key/value count")?;
    let Ok(tensor_count) = u64::try_from(tensor_count) else {
        return Err(c.err(
            tensor_count_at,
            ErrorKind::AbsurdCount,
            format!("negative tensor count {tensor_count}; the file is corrupt"),
        ));
    };
    let Ok(kv_count) = u64::try_from(kv_count) else {
        return Err(c.err(
            kv_count_at,
            ErrorKind::AbsurdCount,
            format!("negative key/value count {kv_count}; the file is corrupt"),
        ));
    };
    c.check_count(kv_count_at, kv_count, MIN_KV_BYTES, "key/value pairs")?;
    // Both tables share the rest of the file, so their sum must fit as well.
    c.check_count(tensor_count_at, tensor_count, MIN_TENSOR_BYTES, "tensors")?;

    Ok((tensor_count, kv_count))
}

/// The key/value pairs: no empty key, none twice.
fn metadata<R: BufRead>(c: &mut Cursor<'_, R>, kv_count: u64) -> Result<Metadata, Error> {
    let mut metadata = Metadata::new();
    for i in 0..kv_count {
        let at = c.pos;
        let key = c.string(&format!("key #{i}"))?;
        if key.is_empty() {
            return Err(c.err(
                at,
                ErrorKind::Malformed,
                format!("key #{i} is empty; the file is corrupt"),
            ));
        }
        let what = format!("key '{key}'");
        let ty = c.value_type(&what)?;
        let value = c.value(ty, &what)?;
        if !metadata.insert(key, value) {
            return Err(c.err(
                at,
                ErrorKind::Malformed,
                format!("{what} appears twice; the file is corrupt"),
            ));
        }
    }

    Ok(metadata)
}

/// `general.alignment`, a u32 power of two, or the default.
fn alignment(metadata: &Metadata, name: &str) -> Result<u64, Error> {
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(v) => {
            let found = match v {
                Value::U32(a) => format!("{a}"),
                other => format!("a {}", other.value_type()),
            };
            return Err(Error::new(
                name,
                None,
                ErrorKind::Malformed,
                format!(
                    "key 'general.alignment' is {found}, must be a u32 power of two; the file is corrupt"
                ),
            ));
        }
    };

    Ok(alignment)
}

/// The tensor infos: counted again now that the metadata is read, no name twice.
fn tensor_table<R: BufRead>(
    c: &mut Cursor<'_, R>,
    tensor_count: u64,
) -> Result<Vec<TensorInfo>, Error> {
    // Counted again now that the metadata is read: it may have eaten the room they claimed.
    let tensors_at = c.pos;
    c.check_count(tensors_at, tensor_count, MIN_TENSOR_BYTES, "tensors")?;
    let mut tensors = Vec::with_capacity((tensor_count as usize).min(MAX_RESERVE));
    let mut names = std::collections::HashSet::new();
    for i in 0..tensor_count {
        let at = c.pos;
        let info = c.tensor_info(i)?;
        if !names.insert(info.name.clone()) {
            return Err(c.err(
                at,
                ErrorKind::Malformed,
                format!("tensor '{}' appears twice; the file is corrupt", info.name),
            ));
        }
        tensors.push(info);
    }

    Ok(tensors)
}
