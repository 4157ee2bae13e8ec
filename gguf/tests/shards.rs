//! Which files make a model, and how much disk its weights take, for single and split GGUFs.

mod common;

use common::{llama_like, scratch_dir};
use gguf::{ErrorKind, model_files, model_size};

#[test]
fn a_single_file_is_the_whole_model() {
    let dir = scratch_dir("single");
    let path = dir.join("model.gguf");
    llama_like().total_size(5 << 30).write(&path).unwrap();
    assert_eq!(model_files(&path).unwrap(), vec![path.clone()]);
    assert_eq!(model_size(&path).unwrap(), 5 << 30);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn any_shard_of_a_split_model_finds_every_shard_and_sums_their_sizes() {
    let dir = scratch_dir("split");
    let names = [
        "Big-Q4-00001-of-00003.gguf",
        "Big-Q4-00002-of-00003.gguf",
        "Big-Q4-00003-of-00003.gguf",
    ];
    for (i, n) in names.iter().enumerate() {
        llama_like()
            .total_size((i as u64 + 1) << 30)
            .write(&dir.join(n))
            .unwrap();
    }
    let expected: Vec<_> = names.iter().map(|n| dir.join(n)).collect();
    for n in names {
        assert_eq!(model_files(&dir.join(n)).unwrap(), expected, "from {n}");
    }
    assert_eq!(model_size(&dir.join(names[1])).unwrap(), 6 << 30);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_missing_shard_is_named() {
    let dir = scratch_dir("missing-shard");
    let first = dir.join("m-00001-of-00003.gguf");
    llama_like().write(&first).unwrap();
    llama_like()
        .write(&dir.join("m-00003-of-00003.gguf"))
        .unwrap();
    let err = model_files(&first).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::MissingShard);
    assert_eq!(
        err.to_string(),
        format!(
            "{}: shard 2 of 3 is missing: {}; download every shard of the model",
            first.display(),
            dir.join("m-00002-of-00003.gguf").display()
        )
    );
    assert_eq!(
        model_size(&first).unwrap_err().kind(),
        ErrorKind::MissingShard
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn names_that_only_look_split_are_single_files() {
    let dir = scratch_dir("odd-names");
    for n in [
        "m-00004-of-00003.gguf",
        "m-00000-of-00003.gguf",
        "m-of-00003.gguf",
        "m-0a001-of-00002.gguf",
        "m-00001-of-00002.bin",
    ] {
        let p = dir.join(n);
        llama_like().write(&p).unwrap();
        assert_eq!(model_files(&p).unwrap(), vec![p.clone()], "{n}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_missing_model_is_an_io_error_naming_it() {
    let dir = scratch_dir("no-model");
    let p = dir.join("nope-00001-of-00002.gguf");
    let err = model_files(&p).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io);
    assert!(
        err.to_string()
            .starts_with(&format!("{}: cannot open:", p.display()))
    );
    std::fs::remove_dir_all(&dir).ok();
}
