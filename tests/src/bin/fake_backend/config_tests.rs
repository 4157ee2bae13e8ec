//! Tests of the command line and environment reading.

use super::*;

fn serve(args: &[&str], env: &[(&str, &str)]) -> Config {
    let args = args.iter().map(|s| s.to_string());
    let lookup = |k: &str| {
        env.iter()
            .find(|(name, _)| *name == k)
            .map(|(_, v)| v.to_string())
    };
    match parse(args, lookup) {
        Ok(Command::Serve(cfg)) => *cfg,
        Ok(_) => panic!("not a serve command"),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn unknown_flags_and_their_values_are_skipped() {
    let cfg = serve(
        &[
            "-m",
            "x.gguf",
            "-ngl",
            "99",
            "--temp",
            "-1",
            "--jinja",
            "--port",
            "0",
            "--cache-reuse",
            "256",
            "--no-webui",
            "--alias",
            "Qwen",
            "--host=::1",
        ],
        &[],
    );
    assert_eq!(cfg.model_path, "x.gguf");
    assert_eq!(cfg.port, 0);
    assert_eq!(cfg.host, "::1");
    assert_eq!(cfg.model_name, "Qwen");
}

#[test]
fn model_name_follows_llama_server() {
    assert_eq!(serve(&["-m", "a/b.gguf"], &[]).model_name, "a/b.gguf");
    assert_eq!(
        serve(&["-m", "a.gguf", "-a", "zeta,alpha"], &[]).model_name,
        "alpha"
    );
    let named = serve(&["-m", "a.gguf", "-a", "x"], &[("FAKE_MODEL_NAME", "y")]);
    assert_eq!(named.model_name, "y");
}

#[test]
fn stderr_lines_split_on_real_and_escaped_newlines() {
    let cfg = serve(&[], &[("FAKE_STDERR_LINES", "one\\ntwo\nthree\n")]);
    assert_eq!(cfg.stderr_lines, ["one", "two", "three"]);
}

#[test]
fn exit_signal_accepts_short_long_and_numeric_names() {
    for name in ["KILL", "sigkill", "9"] {
        let cfg = serve(&[], &[("FAKE_EXIT_SIGNAL", name)]);
        assert_eq!(cfg.exit.signal, Some(Signal::SIGKILL));
    }
    assert!(
        parse(Vec::new(), |k| (k == "FAKE_EXIT_SIGNAL")
            .then(|| "NOPE".into()))
        .is_err()
    );
}

#[test]
fn defaults_match_the_brief() {
    let cfg = serve(&[], &[]);
    assert_eq!(
        (cfg.sse_events, cfg.sse_interval),
        (8, Duration::from_millis(5))
    );
    assert_eq!(cfg.exit.code, 1);
    assert!(cfg.slots_endpoint && !cfg.metrics && !cfg.ds4);
    assert!(!serve(&["--no-slots"], &[]).slots_endpoint);
}

#[test]
fn connections_are_kept_after_a_stream_unless_a_close_is_asked() {
    assert_eq!(serve(&[], &[]).close_after_stream, None);
    let cfg = serve(&[], &[("FAKE_CLOSE_AFTER_STREAM_MS", "300")]);
    assert_eq!(cfg.close_after_stream, Some(Duration::from_millis(300)));
    let at_once = serve(&[], &[("FAKE_CLOSE_AFTER_STREAM_MS", "0")]);
    assert_eq!(at_once.close_after_stream, Some(Duration::ZERO));
}
