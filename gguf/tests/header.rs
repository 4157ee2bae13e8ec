//! Round trips through the writer and the reader, for every value type and the typed getters.

mod common;

use common::{llama_like, parse, scratch_dir};
use gguf::writer::Builder;
use gguf::{Array, ErrorKind, Value, ValueType};

#[test]
fn every_scalar_type_round_trips() {
    let values: Vec<(&str, Value)> = vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-100)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("f32", Value::F32(1.5e-5)),
        ("bool", Value::Bool(true)),
        ("string", Value::String("héllo".into())),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f64", Value::F64(-2.25)),
    ];
    let mut b = Builder::new();
    for (k, v) in &values {
        b = b.kv(*k, v.clone());
    }
    let h = parse(&b.to_bytes()).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.metadata.len(), values.len());
    for ((key, value), (k, v)) in h.metadata.iter().zip(&values) {
        assert_eq!(key, *k, "file order is kept");
        assert_eq!(value, v);
        assert_eq!(value.value_type().name(), *k);
    }
}

#[test]
fn every_array_type_round_trips() {
    let arrays: Vec<Array> = vec![
        vec![1u8, 2].into(),
        vec![-1i8, 2].into(),
        vec![1u16, 65535].into(),
        vec![-1i16, 2].into(),
        vec![1u32, 2, 3].into(),
        vec![-1i32, 0, 8].into(),
        vec![0.5f32, -1.0].into(),
        vec![true, false, true].into(),
        Array::String(vec!["a".into(), String::new(), "ünï".into()]),
        vec![u64::MAX].into(),
        vec![i64::MIN, 0].into(),
        vec![1e300f64].into(),
        Array::U32(Vec::new()),
    ];
    let mut b = Builder::new();
    for (i, a) in arrays.iter().enumerate() {
        b = b.kv(format!("arr.{i}"), a.clone());
    }
    let h = parse(&b.to_bytes()).unwrap();
    for (i, a) in arrays.iter().enumerate() {
        let got = h.get_array(&format!("arr.{i}")).unwrap();
        assert_eq!(got, a);
        assert_eq!(got.len(), a.len());
        assert_eq!(
            h.get(&format!("arr.{i}")).unwrap().value_type(),
            ValueType::Array
        );
    }
}

#[test]
fn version_2_is_read() {
    let h = parse(&llama_like().version(2).to_bytes()).unwrap();
    assert_eq!(h.version, 2);
    assert_eq!(h.architecture(), Some("llama"));
}

#[test]
fn typed_getters_convert_what_callers_mean() {
    let h = parse(
        &Builder::new()
            .kv("general.architecture", "qwen3")
            .kv("a.u8", 7u8)
            .kv("a.i32", 7i32)
            .kv("a.neg", -7i32)
            .kv("a.u64", 7u64)
            .kv("a.f32", 0.25f32)
            .kv("a.bool", true)
            .kv("a.str", "x")
            .to_bytes(),
    )
    .unwrap();
    assert_eq!(h.architecture(), Some("qwen3"));
    assert_eq!(
        h.arch_key("block_count").as_deref(),
        Some("qwen3.block_count")
    );
    for k in ["a.u8", "a.i32", "a.u64"] {
        assert_eq!(h.get_u64(k), Some(7), "{k}: any integer type reads as u64");
    }
    assert_eq!(h.get_u64("a.neg"), None, "a negative integer is no u64");
    assert_eq!(h.get_u64("a.str"), None);
    assert_eq!(h.get_u64("missing"), None);
    assert_eq!(h.get_f64("a.f32"), Some(0.25));
    assert_eq!(h.get_f64("a.i32"), Some(7.0));
    assert_eq!(h.get_bool("a.bool"), Some(true));
    assert_eq!(h.get_bool("a.u8"), None);
    assert_eq!(h.get_str("a.str"), Some("x"));
    assert_eq!(h.u64_checked("a.u8").unwrap(), Some(7));
    assert_eq!(h.u64_checked("missing").unwrap(), None);
    assert_eq!(
        h.u64_checked("a.str").unwrap_err().to_string(),
        "t.gguf: key 'a.str' is a string, expected a non-negative integer"
    );
}

#[test]
fn per_layer_keys_accept_a_scalar_or_a_full_array() {
    let h = parse(
        &Builder::new()
            .kv("scalar", 8u32)
            .kv("ints", vec![8i32, 0, 2])
            .kv("flags", vec![true, false, true])
            .kv("short", vec![1u32, 2])
            .kv("floats", vec![1.0f32, 2.0, 3.0])
            .kv("neg", vec![1i32, -1, 1])
            .kv("text", "x")
            .to_bytes(),
    )
    .unwrap();
    assert_eq!(h.per_layer("scalar", 3).unwrap(), Some(vec![8, 8, 8]));
    assert_eq!(h.per_layer("ints", 3).unwrap(), Some(vec![8, 0, 2]));
    assert_eq!(h.per_layer("flags", 3).unwrap(), Some(vec![1, 0, 1]));
    assert_eq!(h.per_layer("missing", 3).unwrap(), None);
    let err = |k: &str| h.per_layer(k, 3).unwrap_err();
    assert_eq!(
        err("short").to_string(),
        "t.gguf: key 'short' has 2 elements but the model has 3 layers"
    );
    assert_eq!(err("short").kind(), ErrorKind::Metadata);
    assert_eq!(
        err("floats").to_string(),
        "t.gguf: key 'floats' is an array of f32, expected non-negative integers or bools"
    );
    assert!(err("neg").to_string().contains("non-negative"));
    assert_eq!(
        err("text").to_string(),
        "t.gguf: key 'text' is a string, expected an integer or a per-layer array"
    );
}

#[test]
fn tensor_infos_alignment_and_data_offset() {
    let bytes = llama_like().to_bytes();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.tensor_count, 3);
    assert_eq!(h.tensors[1].name, "blk.0.attn_q.weight");
    assert_eq!(h.tensors[1].dims, vec![64, 64]);
    assert_eq!(h.tensors[1].ggml_type, 8);
    assert_eq!(h.tensors[1].offset, 512);
    assert_eq!(h.tensors[2].dims, vec![64]);
    assert_eq!(h.alignment, 32);
    assert_eq!(h.data_offset % 32, 0);
    assert_eq!(
        h.data_offset,
        bytes.len() as u64,
        "the writer pads to the alignment"
    );

    let h = parse(&llama_like().kv("general.alignment", 64u32).to_bytes()).unwrap();
    assert_eq!(h.alignment, 64);
    assert_eq!(h.data_offset % 64, 0);
}

#[test]
fn a_header_without_tensors_has_its_data_right_after_the_metadata() {
    let bytes = Builder::new()
        .kv("general.architecture", "llama")
        .to_bytes();
    let h = parse(&bytes).unwrap();
    assert!(h.tensors.is_empty());
    assert_eq!(h.data_offset, bytes.len() as u64);
}

#[test]
fn invalid_utf8_in_a_string_is_replaced_not_refused() {
    let mut bytes = Builder::new().kv("k", "ab").to_bytes();
    let last = bytes.len() - 1;
    bytes[last] = 0xff;
    let h = parse(&bytes).unwrap();
    assert_eq!(h.get_str("k"), Some("a\u{fffd}"));
}

#[test]
fn a_sparse_4_tib_model_costs_no_disk_and_reads_in_milliseconds() {
    let dir = scratch_dir("sparse");
    let path = dir.join("huge.gguf");
    let tib4 = 4u64 << 40;
    llama_like().total_size(tib4).write(&path).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), tib4);
    let started = std::time::Instant::now();
    let h = gguf::read_header(&path).unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
    assert_eq!(h.architecture(), Some("llama"));
    assert_eq!(gguf::model_size(&path).unwrap(), tib4);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn read_header_names_the_file_it_could_not_open() {
    let dir = scratch_dir("missing");
    let path = dir.join("absent.gguf");
    let err = gguf::read_header(&path).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io);
    assert!(
        err.to_string()
            .starts_with(&format!("{}: cannot open: ", path.display())),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Counts the bytes pulled from the file underneath the reader's buffer.
struct Counting<R> {
    inner: R,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: std::io::Read> std::io::Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

#[test]
fn reading_a_header_reads_the_header_and_no_tensor_data() {
    let dir = scratch_dir("counting");
    let path = dir.join("big.gguf");
    let builder = llama_like().total_size(100 << 30);
    builder.write(&path).unwrap();
    let header_len = builder.to_bytes().len() as u64;
    let read = std::rc::Rc::new(std::cell::Cell::new(0));
    let file = Counting {
        inner: std::fs::File::open(&path).unwrap(),
        read: read.clone(),
    };
    let h = gguf::read_header_from(std::io::BufReader::new(file), 100 << 30, "big.gguf").unwrap();
    assert_eq!(h.data_offset, header_len);
    // One buffer's worth (8 KiB) past the header at most.
    assert!(read.get() <= header_len + 8192, "read {} bytes", read.get());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_lean_read_walks_past_long_arrays_and_keeps_everything_else() {
    let vocab: Vec<String> = (0..10_000).map(|i| format!("tok{i}")).collect();
    let bytes = Builder::new()
        .kv("general.architecture", "llama")
        .kv("tokenizer.ggml.tokens", Value::Array(Array::String(vocab)))
        .kv(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.5; 5000])),
        )
        .kv(
            "llama.attention.head_count_kv",
            Value::Array(Array::U32(vec![8; 64])),
        )
        .kv("llama.block_count", 64u32)
        .tensor("w", &[4, 4], 0, 0)
        .to_bytes();
    let full = parse(&bytes).unwrap();
    let lean = gguf::read_header_lean_from(&bytes[..], bytes.len() as u64, "m.gguf").unwrap();
    assert_eq!(
        lean.get_array("tokenizer.ggml.tokens"),
        Some(&Array::Skipped {
            elem: ValueType::String,
            len: 10_000
        })
    );
    assert_eq!(lean.get_array("tokenizer.ggml.scores").unwrap().len(), 5000);
    assert_eq!(
        lean.get_array("llama.attention.head_count_kv"),
        full.get_array("llama.attention.head_count_kv")
    );
    assert_eq!(lean.get_u64("llama.block_count"), Some(64));
    assert_eq!(lean.tensors, full.tensors);
    assert_eq!(lean.data_offset, full.data_offset);
    // Cut inside the skipped vocabulary: still a clear truncation error.
    let cut = &bytes[..120_000];
    let e = gguf::read_header_lean_from(cut, cut.len() as u64, "m.gguf").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Truncated, "{e}");
}
