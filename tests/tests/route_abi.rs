//! The route ABI: routes built elsewhere load, an incompatible ABI is refused in one line
//! while serve goes on with the routes that loaded, and a panic in a route is contained.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use onebit_tests::*;

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Build `tests/fixtures/route` against a copy of plugin-api stamped `version`, as route
/// `name`, outside the workspace; return the folder holding its library.
fn build_fixture(version: &str, name: &str) -> PathBuf {
    let base = bin_dir().join("abi-fixtures");
    let work = base.join(name);
    let api = work.join("plugin-api");
    let route = work.join("route");
    std::fs::create_dir_all(api.join("src")).unwrap();
    std::fs::create_dir_all(route.join("src")).unwrap();
    for file in ["lib.rs", "types.rs", "loader.rs", "export.rs"] {
        std::fs::copy(
            root().join("plugin-api/src").join(file),
            api.join("src").join(file),
        )
        .unwrap();
    }
    std::fs::write(
        api.join("Cargo.toml"),
        format!(
            "[package]\nname = \"onebit-plugin-api\"\nversion = \"{version}\"\nedition = \"2024\"\n\n\
             [dependencies]\nabi_stable = \"0.11.3\"\nsemver = \"1\"\n\
             serde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n\n\
             [features]\nhost = []\n"
        ),
    )
    .unwrap();
    std::fs::copy(
        root().join("tests/fixtures/route/src/lib.rs"),
        route.join("src/lib.rs"),
    )
    .unwrap();
    std::fs::write(
        route.join("Cargo.toml"),
        format!(
            "[package]\nname = \"onebit-route-{name}\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n\
             [lib]\nname = \"onebit_route_{name}\"\ncrate-type = [\"cdylib\"]\n\n\
             [dependencies]\nonebit-plugin-api = {{ path = \"../plugin-api\" }}\n"
        ),
    )
    .unwrap();
    std::fs::write(
        work.join("Cargo.toml"),
        "[workspace]\nresolver = \"3\"\nmembers = [\"plugin-api\", \"route\"]\n",
    )
    .unwrap();
    std::fs::copy(root().join("Cargo.lock"), work.join("Cargo.lock")).unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--offline", "--manifest-path"])
        .arg(work.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", base.join("target"))
        .env("FIXTURE_ROUTE_NAME", name)
        .status()
        .unwrap();
    assert!(status.success(), "the {name} fixture route builds");
    let dir = work.join("plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let lib = format!("libonebit_route_{name}.so");
    std::fs::copy(base.join("target/debug").join(&lib), dir.join(&lib)).unwrap();
    dir
}

/// The three fixtures, built once per test run: (same ABI, newer minor, next major).
fn fixtures() -> &'static (PathBuf, PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let host = onebit_plugin_api::ABI_VERSION;
        let v = semver::Version::parse(host).unwrap();
        (
            build_fixture(host, "outside"),
            build_fixture(&format!("{}.{}.0", v.major, v.minor + 1), "newerminor"),
            build_fixture(&format!("{}.0.0", v.major + 1), "nextmajor"),
        )
    })
}

fn plugins(dir: &Path) -> String {
    let out = Command::new(onebit())
        .args(["plugins", "--plugin-dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_route_built_outside_the_workspace_loads_and_serves() {
    let (same, _, _) = fixtures();
    let listing = plugins(same);
    assert!(listing.contains("outside "), "{listing}");
    assert!(
        listing.contains("loaded: a route built outside the workspace"),
        "{listing}"
    );
    let dir = temp_dir("outside");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--device",
            "outside",
            "--plugin-dir",
            same.to_str().unwrap(),
            "--llama-server",
            fake_backend().to_str().unwrap(),
        ],
        &[],
    );
    serve.ready();
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
}

#[test]
fn routes_are_found_through_onebit_plugin_path_and_the_backend_gets_the_plan_env_where_unset() {
    let (same, _, _) = fixtures();
    let dir = temp_dir("plugin-path");
    let model = dummy_model(&dir, "m.gguf");
    let path = format!("/nonexistent/dir:{}", same.display());
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--device",
            "outside",
            "--llama-server",
            fake_backend().to_str().unwrap(),
        ],
        &[
            ("ONEBIT_PLUGIN_PATH", &path),
            ("FIXTURE_SET_BY_USER", "user"),
        ],
    );
    serve.ready();
    let backend = serve.children()[0];
    let environ = std::fs::read(format!("/proc/{backend}/environ")).unwrap();
    let vars: Vec<String> = environ
        .split(|b| *b == 0)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    assert!(
        vars.contains(&"FIXTURE_FROM_PLAN=plan".to_string()),
        "{vars:?}"
    );
    assert!(
        vars.contains(&"FIXTURE_SET_BY_USER=user".to_string()),
        "the user's value wins"
    );
    assert!(
        vars.iter().any(|v| v.starts_with("PATH=")),
        "serve's own environment is passed on"
    );
}

#[test]
fn another_major_or_a_newer_minor_is_refused_in_one_line_and_serve_goes_on() {
    let (_, newer_minor, next_major) = fixtures();
    let host = onebit_plugin_api::ABI_VERSION;
    for (dir, name) in [(next_major, "nextmajor"), (newer_minor, "newerminor")] {
        let listing = plugins(dir);
        let line = listing
            .lines()
            .find(|l| l.contains(&format!("libonebit_route_{name}.so")))
            .unwrap_or_else(|| panic!("{listing}"));
        assert!(line.contains("not loaded"), "{line}");
        assert!(
            line.contains(&format!("this 1bit has ABI {host}")),
            "{line}"
        );

        let tmp = temp_dir(name);
        let model = dummy_model(&tmp, "m.gguf");
        let serve = Serve::start(
            &[
                "-m",
                model.to_str().unwrap(),
                "--device",
                "cpu",
                "--plugin-dir",
                dir.to_str().unwrap(),
                "--llama-server",
                fake_backend().to_str().unwrap(),
            ],
            &[],
        );
        serve.ready();
        let out = serve.output();
        let refused: Vec<&str> = out
            .lines()
            .filter(|l| l.contains(&format!("libonebit_route_{name}.so")))
            .collect();
        assert_eq!(refused.len(), 1, "{out}");
        assert!(
            refused[0].starts_with("1bit serve: skipping a route: "),
            "{out}"
        );
        assert!(refused[0].contains("built against route ABI"), "{out}");
    }
}

#[test]
fn a_route_that_panics_is_an_error_not_a_crash() {
    let (same, _, _) = fixtures();
    let dir = temp_dir("panic");
    let model = dummy_model(&dir, "panic-in-plan.gguf");
    let mut serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--device",
            "outside",
            "--plugin-dir",
            same.to_str().unwrap(),
            "--llama-server",
            fake_backend().to_str().unwrap(),
        ],
        &[],
    );
    let exit = serve
        .wait_exit(Duration::from_secs(10))
        .expect("serve exits");
    assert_eq!(exit.code(), Some(1), "{}", serve.output());
    assert!(
        serve
            .output()
            .contains("the outside route failed to plan: the route panicked in plan: the fixture was asked to panic"),
        "{}",
        serve.output()
    );
}
