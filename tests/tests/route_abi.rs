//! The route ABI: routes built elsewhere load, an incompatible ABI is refused in one line
//! while serve goes on with the routes that loaded, and a panic in a route is contained.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use onebit_tests::*;

/// Build `tests/fixtures/route` against this plugin-api stamped `version`, as route `name`,
/// outside the workspace; return the folder holding its library.
fn build_fixture(version: &str, name: &str) -> PathBuf {
    route_fixture::Fixture::current(name, "tests/fixtures/route/src/lib.rs", version).build()
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
    let start = dir.join("start.json");
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
        &[("FAKE_RECORD_START", start.to_str().unwrap())],
    );
    serve.ready();
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
    // The fake backend recorded the argv and environment the route's plan gave it.
    let started: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&start).unwrap()).unwrap();
    let argv: Vec<&str> = started["argv"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(argv[1..3], ["-m", model.to_str().unwrap()], "{argv:?}");
    assert_eq!(argv[3], "--port");
    assert_eq!(started["env"]["FIXTURE_FROM_PLAN"], "plan", "{started}");
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
    assert!(
        !serve.output().contains("panicked at"),
        "serve's line only, not Rust's panic message: {}",
        serve.output()
    );
}

/// The fixture route built against the frozen copy of an older layout's plugin-api
/// (`tests/fixtures/plugin-api-<minor>`), as route `name`.
fn build_old_fixture(minor: &str, name: &str) -> PathBuf {
    route_fixture::Fixture {
        name,
        route_source: route_fixture::root().join("tests/fixtures/route/src/lib.rs"),
        api_source: route_fixture::root().join(format!("tests/fixtures/plugin-api-{minor}/src")),
        api_version: &format!("{minor}.0"),
    }
    .build()
}

#[test]
fn routes_built_against_each_layout_of_the_root_module_load_and_serve() {
    // One route per layout of the root module the loader knows (plugin-api/src/legacy.rs):
    // 1.0-1.1 and 1.2-1.4 from their frozen copies, 1.5 on from this plugin-api stamped 1.5.0
    // (the minors of one layout differ only in JSON, whose absent fields read as defaults, as
    // the 1.0 route's prove).
    for (minor, name) in [("1.0", "v10"), ("1.4", "v14"), ("1.5", "v15")] {
        let dir = if minor == "1.5" {
            route_fixture::Fixture::current(name, "tests/fixtures/route/src/lib.rs", "1.5.0")
                .build()
        } else {
            build_old_fixture(minor, name)
        };
        let listing = plugins(&dir);
        let line = listing
            .lines()
            .find(|l| l.contains(&format!("libonebit_route_{name}.so")))
            .unwrap_or_else(|| panic!("{listing}"));
        assert!(
            line.contains(&format!("ABI {minor}.0  loaded: ")),
            "{listing}"
        );

        let tmp = temp_dir(name);
        let model = dummy_model(&tmp, "m.gguf");
        let serve = Serve::start(
            &[
                "-m",
                model.to_str().unwrap(),
                "--device",
                name,
                "--plugin-dir",
                dir.to_str().unwrap(),
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
        // Its health and metrics operations are called as a current route's are.
        let (status, _) = get(&serve.url("/metrics"));
        assert_eq!(status, 200);
    }
}

#[test]
fn route_options_to_a_route_older_than_1_2_are_refused_not_ignored() {
    let dir = build_old_fixture("1.0", "v10");
    let tmp = temp_dir("old-opts");
    let model = dummy_model(&tmp, "m.gguf");
    let out = Command::new(onebit())
        .args(["serve", "-m"])
        .arg(&model)
        .args(["--device", "v10", "--route-opt", "x=1", "--plugin-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--route-opt: the v10 route was built against route ABI 1.0.0, which takes no route options"),
        "{stderr}"
    );
}

#[test]
fn plugins_names_a_library_that_is_no_route_and_a_route_whose_name_is_not_its_files() {
    let (same, _, _) = fixtures();
    let dir = temp_dir("plugins-odd");
    let built = same.join("libonebit_route_outside.so");
    std::fs::copy(&built, dir.join("libonebit_route_renamed.so")).unwrap();
    std::fs::copy(&built, dir.join("libhelper.so")).unwrap();
    std::fs::write(dir.join("notes.so.txt"), "not a library").unwrap();
    let listing = plugins(&dir);
    let renamed = listing
        .lines()
        .find(|l| l.contains("libonebit_route_renamed.so"))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        renamed.starts_with("outside ")
            && renamed.ends_with(
                "(the route names itself outside, its file says renamed: use --device outside)"
            ),
        "{listing}"
    );
    let helper = listing
        .lines()
        .find(|l| l.contains("libhelper.so"))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        helper.ends_with(
            "not loaded: a shared library, but not a route file (route files are named libonebit_route_<name>.so)"
        ),
        "{listing}"
    );
    assert!(!listing.contains("notes.so.txt"), "{listing}");
}

#[test]
fn plugin_api_copied_out_of_the_workspace_is_a_crate_cargo_package_accepts() {
    // A vendor copies the crate out (or depends on it by git or registry): it must stand
    // alone, with nothing inherited from this workspace.
    let copy = temp_dir("plugin-api-copy");
    std::fs::create_dir_all(copy.join("src")).unwrap();
    let api = route_fixture::root().join("plugin-api");
    for file in ["Cargo.toml", "README.md"] {
        std::fs::copy(api.join(file), copy.join(file)).unwrap();
    }
    for entry in std::fs::read_dir(api.join("src")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.join("src").join(path.file_name().unwrap())).unwrap();
    }
    std::fs::copy(
        route_fixture::root().join("Cargo.lock"),
        copy.join("Cargo.lock"),
    )
    .unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let out = Command::new(cargo)
        .args([
            "package",
            "--no-verify",
            "--offline",
            "--allow-dirty",
            "--manifest-path",
        ])
        .arg(copy.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", bin_dir().join("package-check"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The fenced block of `lang` that follows `heading` in docs/plugins.md.
fn docs_block(heading: &str, lang: &str) -> String {
    let docs = std::fs::read_to_string(route_fixture::root().join("docs/plugins.md")).unwrap();
    let section = &docs[docs
        .find(heading)
        .expect("the section is in docs/plugins.md")..];
    let open = format!("```{lang}\n");
    let start = section.find(&open).expect("the block is in the section") + open.len();
    section[start..start + section[start..].find("```").unwrap()].to_string()
}

#[test]
fn the_docs_route_template_builds_inside_another_workspaces_tree_and_its_tests_link_it() {
    // docs/plugins.md's Cargo.toml and lib.rs, as a vendor copies them, in a folder inside this
    // workspace's tree (which needs the template's empty [workspace] table), with the
    // dependency's path pointed at this checkout, and a test of its own in tests/ (which needs
    // the rlib crate type).
    let heading = "## Building and shipping a route outside this repository";
    let manifest = docs_block(heading, "toml");
    let abi: Vec<&str> = onebit_plugin_api::ABI_VERSION.split('.').take(2).collect();
    let line = format!(
        "onebit-plugin-api = {{ path = \"../1bit/plugin-api\", version = \"{}\" }}",
        abi.join(".")
    );
    assert!(
        manifest.lines().any(|l| l == line),
        "the template's dependency line is `{line}`:\n{manifest}"
    );
    let api = route_fixture::root().join("plugin-api");
    let manifest = manifest.replace("../1bit/plugin-api", api.to_str().unwrap());
    let work = bin_dir().join("abi-fixtures/docs-template");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(work.join("src")).unwrap();
    std::fs::create_dir_all(work.join("tests")).unwrap();
    std::fs::write(work.join("Cargo.toml"), manifest).unwrap();
    std::fs::write(work.join("src/lib.rs"), docs_block(heading, "rust")).unwrap();
    std::fs::write(
        work.join("tests/info.rs"),
        "use onebit_plugin_api::DeviceRoute;\n\n#[test]\nfn it_names_itself() {\n    assert_eq!(onebit_route_myvendor::MyRoute.info().name, \"myvendor\");\n}\n",
    )
    .unwrap();
    std::fs::copy(
        route_fixture::root().join("Cargo.lock"),
        work.join("Cargo.lock"),
    )
    .unwrap();
    assert!(
        work.starts_with(route_fixture::root()),
        "inside the workspace's tree"
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let run = |what: &str| {
        let out = Command::new(&cargo)
            .args([what, "--offline", "--manifest-path"])
            .arg(work.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", bin_dir().join("abi-fixtures/target"))
            .output()
            .unwrap();
        let said = output_text(&out);
        assert!(out.status.success(), "cargo {what}: {said}");
        said
    };
    run("build");
    let said = run("test");
    assert!(said.contains("test it_names_itself ... ok"), "{said}");
    assert!(
        bin_dir()
            .join("abi-fixtures/target/debug/libonebit_route_myvendor.so")
            .exists(),
        "{said}"
    );
}
