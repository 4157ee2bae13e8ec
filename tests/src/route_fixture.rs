//! Building a test route outside the workspace, as a vendor would: a route crate against a
//! copy of onebit-plugin-api (this one, or a frozen copy of an older layout) stamped with a
//! chosen ABI version. Used by the ABI tests; each build goes to its own folder under `target/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bin_dir;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
        .to_path_buf()
}

/// One fixture build.
pub struct Fixture<'a> {
    /// The route's name (`--device NAME`, `libonebit_route_NAME.so`).
    pub name: &'a str,
    /// The route's `lib.rs`.
    pub route_source: PathBuf,
    /// The folder of the plugin-api sources to build against (`plugin-api/src`, or a frozen
    /// copy under `tests/fixtures`).
    pub api_source: PathBuf,
    /// The version the API copy is stamped with.
    pub api_version: &'a str,
}

impl Fixture<'_> {
    /// The route crate `route_source` against this workspace's plugin-api at `api_version`.
    pub fn current<'a>(name: &'a str, route_source: &str, api_version: &'a str) -> Fixture<'a> {
        Fixture {
            name,
            route_source: root().join(route_source),
            api_source: root().join("plugin-api/src"),
            api_version,
        }
    }

    /// Build it (offline, with the workspace's lock file) and return the folder holding its
    /// library and nothing else.
    pub fn build(&self) -> PathBuf {
        let name = self.name;
        let base = bin_dir().join("abi-fixtures");
        let work = base.join(name);
        let api = work.join("plugin-api");
        let route = work.join("route");
        std::fs::create_dir_all(api.join("src")).unwrap();
        std::fs::create_dir_all(route.join("src")).unwrap();
        for entry in std::fs::read_dir(&self.api_source).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                std::fs::copy(&path, api.join("src").join(path.file_name().unwrap())).unwrap();
            }
        }
        let version = self.api_version;
        // libc: the frozen 1.4 copy still holds the spawner (onebit-process since 1.8).
        std::fs::write(
            api.join("Cargo.toml"),
            format!(
                "[package]\nname = \"onebit-plugin-api\"\nversion = \"{version}\"\nedition = \"2024\"\n\n\
                 [dependencies]\nabi_stable = \"0.11.3\"\nlibc = \"0.2\"\nsemver = \"1\"\n\
                 serde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n\n\
                 [features]\nhost = []\n"
            ),
        )
        .unwrap();
        std::fs::copy(&self.route_source, route.join("src/lib.rs")).unwrap();
        std::fs::write(
            route.join("Cargo.toml"),
            format!(
                "[package]\nname = \"onebit-route-{name}\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n\
                 [lib]\nname = \"onebit_route_{name}\"\ncrate-type = [\"cdylib\"]\n\n\
                 [dependencies]\nonebit-plugin-api = {{ path = \"../plugin-api\" }}\nlibc = \"0.2\"\n\
                 serde = {{ version = \"1\", features = [\"derive\"] }}\nserde_json = \"1\"\n"
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
        crate::place_library(&base.join("target/debug").join(&lib), &dir);
        dir
    }
}
