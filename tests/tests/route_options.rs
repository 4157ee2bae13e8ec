//! Route options: `--route-opt KEY=VALUE` and `--npu-opt KEY=VALUE` reach the chosen route as
//! opaque pairs, the route refuses a key it does not know in one line naming the keys it
//! knows, and a route that takes none (cpu) refuses any.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use onebit_tests::*;

fn fixture() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        route_fixture::Fixture::current(
            "inproc",
            "tests/fixtures/inproc-route/src/lib.rs",
            onebit_plugin_api::ABI_VERSION,
        )
        .build()
    })
}

/// `1bit serve ARGS` run to its end (bounded): (exit code, everything it printed).
fn refused(args: &[&str]) -> (i32, String) {
    let mut serve = Serve::start(args, &[]);
    let status = serve.wait_exit(Duration::from_secs(10));
    let code = status.and_then(|s| s.code()).unwrap_or(-1);
    (code, serve.output())
}

#[test]
fn route_and_npu_options_reach_the_route() {
    let dir = temp_dir("route-opt");
    let model = dummy_model(&dir, "m.bin");
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--device",
            "inproc",
            "--plugin-dir",
            fixture().to_str().unwrap(),
            "--route-opt",
            "pace_ms=1",
            "--npu-opt",
            "event_bytes=7",
        ],
        &[],
    );
    serve.ready();
    let (status, body) = post(&serve.url("/v1/chat/completions"), r#"{"messages":[]}"#);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("in process; options event_bytes=7,pace_ms=1"),
        "{body}"
    );
    let events = sse(
        &serve.url("/v1/chat/completions"),
        r#"{"stream":true,"events":1}"#,
    );
    assert!(events[0].contains(r#""p":"xxxxxxx""#), "{events:?}");
}

#[test]
fn an_unknown_or_malformed_option_is_refused_in_one_line() {
    let dir = temp_dir("route-opt-bad");
    let model = dummy_model(&dir, "m.gguf");
    let m = model.to_str().unwrap();
    let plugins = fixture().to_str().unwrap();
    let fake = fake_backend();
    let fake = fake.to_str().unwrap();
    let cases: [(Vec<&str>, &str); 4] = [
        (
            vec![
                "--device",
                "inproc",
                "--plugin-dir",
                plugins,
                "--npu-opt",
                "turbo=on",
            ],
            "1bit serve: --npu-opt turbo=on: the inproc route has no option turbo; it knows event_bytes, pace_ms\n",
        ),
        (
            vec![
                "--device",
                "inproc",
                "--plugin-dir",
                plugins,
                "--route-opt",
                "pace_ms=soon",
            ],
            "1bit serve: route option pace_ms=soon: not a whole number; pass one such as pace_ms=10\n",
        ),
        (
            vec![
                "--device",
                "cpu",
                "--llama-server",
                fake,
                "--route-opt",
                "threads=4",
            ],
            "1bit serve: --route-opt threads=4: the cpu route has no option threads; it takes no options\n",
        ),
        (
            vec![
                "--device",
                "cpu",
                "--llama-server",
                fake,
                "--route-opt",
                "threads",
            ],
            "1bit serve: --route-opt threads: not KEY=VALUE; pass it as --route-opt KEY=VALUE\n",
        ),
    ];
    for (extra, line) in cases {
        let mut args = vec!["-m", m];
        args.extend(extra.iter().copied());
        let (code, stderr) = refused(&args);
        assert_eq!(code, 2, "{extra:?}: {stderr}");
        assert!(stderr.ends_with(line), "{extra:?}: {stderr}");
        assert_eq!(stderr.matches("1bit serve: ").count(), 1, "{stderr}");
    }
}
