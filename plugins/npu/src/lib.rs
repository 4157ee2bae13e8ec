//! The npu device route: an NPU model directory (`model.q4nx`, `config.json`, `tokenizer.json`,
//! `npu/` kernels; docs/npu.md), answered in process. It recognizes and claims such a directory,
//! checks for the NPU (an `amdxdna` accel device) and the kernels, and refuses in one line what
//! it cannot serve. The NPU lane runtime (XRT) is not part of this build, so on a machine that
//! has everything the route still refuses, saying so; an add-on route that claims the directory
//! (a vendor's, docs/plugins.md) outranks this one under `--device auto`.
#![deny(unsafe_code)]

use std::path::{Path, PathBuf};

use onebit_plugin_api::{
    Claim, DeviceRoute, Plan, PlanRequest, Purpose, Refusal, RouteInfo, export_route,
};

/// The files that make a directory an NPU model directory.
pub const MODEL_FILES: [&str; 3] = ["model.q4nx", "config.json", "tokenizer.json"];
/// The kernels the lane needs, in `npu/`.
pub const KERNELS: [&str; 3] = ["layer_ctx1.elf", "lmhead.elf", "layer.pdi"];
/// The kernel driver of the NPU on Strix Halo (`drivers/accel/amdxdna`).
pub const DRIVER: &str = "amdxdna";
/// The `model_type` of Qwen3.6-35B-A3B, which only a closed add-on route serves.
pub const ADD_ON_MODEL_TYPE: &str = "qwen3_5_moe";
/// How strongly this route claims an NPU model directory: it owns the format. An add-on route
/// that serves a directory claims more (95), and wins.
pub const CLAIM: u8 = 90;

#[derive(Default)]
pub struct NpuRoute;

/// What the directory is, as far as the route can tell from its files.
#[derive(Debug, PartialEq)]
enum Model {
    /// Not a directory, or a directory without the files.
    Not { missing: Vec<&'static str> },
    /// An NPU model directory, with its `config.json`'s `model_type` (empty when unnamed).
    Dir { model_type: String },
}

fn model(request: &PlanRequest) -> Model {
    let dir = Path::new(&request.model.path);
    if !request.model.is_dir {
        return Model::Not {
            missing: MODEL_FILES.to_vec(),
        };
    }
    let missing: Vec<&str> = MODEL_FILES
        .iter()
        .copied()
        .filter(|f| !dir.join(f).is_file())
        .collect();
    if !missing.is_empty() {
        return Model::Not { missing };
    }
    let model_type = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|config| config["model_type"].as_str().map(str::to_string))
        .unwrap_or_default();
    Model::Dir { model_type }
}

/// The accel devices bound to `amdxdna`, from `<sysfs>/class/accel/*/device/driver` (the
/// sysfs root is `ONEBIT_SYSFS_ROOT`, else `/sys`).
fn npu_devices(request: &PlanRequest) -> (PathBuf, Vec<String>) {
    let root = request
        .env
        .get("ONEBIT_SYSFS_ROOT")
        .filter(|r| !r.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/sys"));
    let class = root.join("class/accel");
    let mut found: Vec<String> = std::fs::read_dir(&class)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_link(e.path().join("device/driver"))
                .ok()
                .and_then(|target| target.file_name().map(|n| n == DRIVER))
                .unwrap_or(false)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    (class, found)
}

impl DeviceRoute for NpuRoute {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: "npu".to_string(),
            summary: "an NPU model directory on the NPU (amdxdna), in process".to_string(),
        }
    }

    fn claim(&self, request: &PlanRequest) -> Claim {
        match model(request) {
            Model::Dir { .. } => Claim {
                strength: CLAIM,
                reason: "an NPU model directory (model.q4nx)".to_string(),
            },
            Model::Not { .. } => Claim::none(),
        }
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        request.options.checked_route_options("npu", &[])?;
        if request.purpose == Purpose::PrintBackend {
            // The engine runs inside serve: there is no backend for Lemonade to start.
            return Err(Refusal::needs_serve("--device npu"));
        }
        let path = &request.options.model;
        let model_type = match model(request) {
            Model::Dir { model_type } => model_type,
            Model::Not { .. } if !request.model.is_dir => {
                return Err(Refusal::usage(format!(
                    "{path}: --device npu serves an NPU model directory (model.q4nx, config.json, tokenizer.json, npu/; docs/npu.md); a .gguf runs on --device hrx or cpu"
                )));
            }
            Model::Not { missing } => {
                return Err(Refusal::usage(format!(
                    "{path} is not an NPU model directory: it lacks {} (docs/npu.md)",
                    missing.join(", ")
                )));
            }
        };
        if model_type == ADD_ON_MODEL_TYPE {
            return Err(Refusal::usage(format!(
                "{path}: the Qwen3.6-35B-A3B NPU route is not part of this build; add the NPU add-on route (a route library that claims model_type {ADD_ON_MODEL_TYPE}) to a plugin folder, see docs/plugins.md"
            )));
        }
        let (class, devices) = npu_devices(request);
        if devices.is_empty() {
            return Err(Refusal::engine(format!(
                "no NPU: no accel device bound to {DRIVER} under {}; load the amdxdna driver (Linux 6.14 or later), or serve the model's GGUF with --device hrx or cpu",
                class.display()
            )));
        }
        let kernels = Path::new(path).join("npu");
        let missing: Vec<&str> = KERNELS
            .iter()
            .copied()
            .filter(|k| !kernels.join(k).is_file())
            .collect();
        if !missing.is_empty() {
            return Err(Refusal::usage(format!(
                "{}: the NPU kernels {} are missing; copy the model's npu/ folder beside model.q4nx (docs/npu.md)",
                kernels.display(),
                missing.join(", ")
            )));
        }
        Err(Refusal::engine(format!(
            "{path}: the NPU lane runtime (XRT) is not part of this build yet ({} found, kernels present); serve it with an NPU add-on route, or serve the model's GGUF with --device hrx",
            devices.join(", ")
        )))
    }
}

export_route!(NpuRoute);

#[cfg(test)]
mod tests {
    use super::*;

    fn request(dir: &Path) -> PlanRequest {
        let mut r = PlanRequest::default();
        r.options.model = dir.to_string_lossy().into_owned();
        r.model.path = r.options.model.clone();
        r.model.is_dir = dir.is_dir();
        r
    }

    #[test]
    fn a_directory_with_the_three_files_is_claimed_and_one_without_is_not() {
        let dir = std::env::temp_dir().join(format!("onebit-npu-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.q4nx"), b"").unwrap();
        std::fs::write(dir.join("config.json"), br#"{"model_type":"qwen3"}"#).unwrap();
        assert_eq!(NpuRoute.claim(&request(&dir)).strength, 0);
        let refusal = NpuRoute.plan(&request(&dir)).unwrap_err();
        assert!(
            refusal
                .message
                .ends_with("it lacks tokenizer.json (docs/npu.md)")
        );
        std::fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
        assert_eq!(NpuRoute.claim(&request(&dir)).strength, CLAIM);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
