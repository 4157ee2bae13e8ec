//! `1bit gguf stub` and `1bit gguf inspect`, run as a user runs them: a stub inspects as
//! written, serve's memory check reads it as a model of its size, and a file that is not a
//! whole GGUF is one line on stderr, exit 2.

use std::process::{Command, Output};

use onebit_tests::*;

/// `1bit ARGS…`, run to its end.
fn onebit_run(args: &[&str]) -> Output {
    Command::new(onebit()).args(args).output().unwrap()
}

fn stdout_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn a_stub_inspects_as_written_and_the_memory_check_reads_its_size() {
    let dir = temp_dir("gguf-stub");
    let model = dir.join("tiny.gguf");
    let m = model.to_str().unwrap();
    let out = onebit_run(&[
        "gguf",
        "stub",
        m,
        "--size",
        "4398046511104",
        "--layers",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    let said = stdout_lines(&out);
    assert_eq!(said.len(), 1, "{said:#?}");
    assert!(
        said[0].starts_with(&format!(
            "wrote {m}: a header-only GGUF v3 (llama \"tiny\": 3 layers, 4 heads, 4 KV heads, embd 64, ctx 2048, file type 2), 4398046511104 bytes, sparse past the "
        )),
        "{said:#?}"
    );
    // Sparse: a 4 TiB file on a few KiB of disk.
    assert_eq!(std::fs::metadata(&model).unwrap().len(), 4 << 40);

    let out = onebit_run(&["gguf", "inspect", m]);
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    assert!(out.stderr.is_empty(), "{}", output_text(&out));
    assert_eq!(
        stdout_lines(&out),
        [
            format!("path: {m}"),
            "bytes: 4398046511104".to_string(),
            "architecture: llama".to_string(),
            "name: tiny".to_string(),
            "file type: 2".to_string(),
            "layers: 3".to_string(),
            "context length: 2048".to_string(),
            "embedding length: 64".to_string(),
            "heads: 4".to_string(),
            "kv heads: 4".to_string(),
            "expert count: (none)".to_string(),
            "weights: 4398046511104 bytes (4096.00 GiB)".to_string(),
            // 2048 cells x 3 layers x (K + V) x 4 heads x 16 wide x 2 bytes.
            "kv/state: 1572864 bytes (1.50 MiB) at ctx 2048 (the model's own; f16, 4 slots sharing one cache)".to_string(),
        ]
    );

    // A second stub over it is refused; --force replaces it.
    let out = onebit_run(&["gguf", "stub", m]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!("1bit gguf stub: {m} exists; pass --force to replace it, or another path\n")
    );
    let out = onebit_run(&["gguf", "stub", m, "--force", "--heads", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "1bit gguf stub: --heads 0: a model has at least one head; pass --heads 1 or more\n"
    );

    // serve's memory check reads the stub as a 4 TiB model and refuses it before any backend.
    let out = onebit_run(&[
        "serve",
        "-m",
        m,
        "--device",
        "cpu",
        "--llama-server",
        fake_backend().to_str().unwrap(),
        "--mem-check",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("tiny does not fit: need 4096.5"),
        "{}",
        output_text(&out)
    );
}

#[test]
fn a_file_that_is_not_a_whole_gguf_is_one_line_and_exit_2() {
    let dir = temp_dir("gguf-inspect-bad");
    let whole = dir.join("whole.gguf");
    let out = onebit_run(&["gguf", "stub", whole.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    let bytes = std::fs::read(&whole).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
    let text = dir.join("text.gguf");
    std::fs::write(&text, b"hello, not a gguf").unwrap();
    let missing = dir.join("missing.gguf");
    for (file, ending) in [
        (&cut, "; the file is incomplete, download it again"),
        (
            &text,
            ": byte 0: not a GGUF file (magic 68656c6c); pass a .gguf model",
        ),
        (
            &missing,
            ": no such file; pass the path of a .gguf model (1bit gguf stub writes one)",
        ),
    ] {
        let f = file.to_str().unwrap();
        let out = onebit_run(&["gguf", "inspect", f]);
        assert_eq!(out.status.code(), Some(2), "{f}: {}", output_text(&out));
        assert!(out.stdout.is_empty(), "{f}: {}", output_text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.lines().count(), 1, "{f}: {stderr}");
        assert!(
            stderr.starts_with(&format!("1bit gguf inspect: {f}: ")),
            "{f}: {stderr}"
        );
        assert!(stderr.trim_end().ends_with(ending), "{f}: {stderr}");
    }
}
