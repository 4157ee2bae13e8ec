//! llama.cpp's layer split across RPC workers, and the memory check that counts each part
//! where it will live: the layers that stay against this machine, the rest against each worker.
//!
//! The rule is llama.cpp's own (`llama_model_base::load_tensors`, src/llama-model.cpp): the
//! devices are the workers' in `--rpc` order, then this machine's GPU; layer `il` of
//! `n_layer + 1` (the last is the output layer) goes to the first device whose cumulative
//! share of the devices' free memory exceeds `il / n_gpu_layers`; layers below
//! `n_layer + 1 - n_gpu_layers` and the input layer (token embeddings) stay on this CPU.

use std::path::Path;

use onebit_plugin_api::{MemoryNeed, Plan};

use crate::admission::{self, MARGIN_BYTES};
use crate::rpc::probe::Offer;
use onebit_command::cli::ServeArgs;
use onebit_command::error::{Fatal, exit};

const GIB: f64 = (1u64 << 30) as f64;
/// The part that stays on the machine serve runs on.
const LOCAL: &str = "this machine";

/// Where one layer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Home {
    /// This machine's CPU.
    Cpu,
    /// Device `n` of llama.cpp's device list.
    Device(usize),
}

/// Which device each of the `n_layer + 1` layers goes to, as llama.cpp decides it from each
/// device's free memory (f32 arithmetic, as llama.cpp's). Pure.
pub fn assign(n_layer: usize, n_gpu_layers: usize, device_free: &[u64]) -> Vec<Home> {
    let n_devices = device_free.len();
    let mut splits: Vec<f32> = device_free.iter().map(|&f| f as f32).collect();
    if splits.iter().all(|s| *s == 0.0) {
        splits.iter_mut().for_each(|s| *s = 1.0);
    }
    let mut sum = 0.0f32;
    for s in splits.iter_mut() {
        sum += *s;
        *s = sum;
    }
    for s in splits.iter_mut() {
        *s /= sum;
    }
    let start = (n_layer + 1).saturating_sub(n_gpu_layers);
    let active = if n_devices == 0 {
        0
    } else {
        n_gpu_layers.min(n_layer + 1)
    };
    (0..=n_layer)
        .map(|il| {
            if il < start || il - start >= active {
                return Home::Cpu;
            }
            let x = (il - start) as f32 / active as f32;
            let d = splits.partition_point(|s| *s <= x);
            Home::Device(d.min(n_devices - 1))
        })
        .collect()
}

/// The weight bytes of the input layer, each block, and the output layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerWeights {
    pub input: u64,
    pub blocks: Vec<u64>,
    pub output: u64,
    /// The output reuses the token embeddings (no `output.weight`); a device that holds the
    /// output layer then holds a copy of them too.
    pub tied_output: bool,
}

/// Each layer's weights from the GGUF's tensor table (a tensor's size is the distance to the
/// next one's data); a header without tensors, or a sharded model, is spread evenly over the
/// blocks and the output.
pub fn layer_weights(model: &Path, n_layer: usize, total: u64) -> LayerWeights {
    let even = || {
        let share = total / (n_layer as u64 + 1);
        LayerWeights {
            input: 0,
            blocks: vec![share; n_layer],
            output: total - share * n_layer as u64,
            tied_output: false,
        }
    };
    let Ok(header) = gguf::read_header_lean(model) else {
        return even();
    };
    let file_len = std::fs::metadata(model).map(|m| m.len()).unwrap_or(0);
    if header.tensors.is_empty() || gguf::model_files(model).map(|f| f.len()).unwrap_or(1) > 1 {
        return even();
    }
    let mut order: Vec<&gguf::TensorInfo> = header.tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    let data_len = file_len.saturating_sub(header.data_offset);
    let mut out = LayerWeights {
        input: 0,
        blocks: vec![0; n_layer],
        output: 0,
        tied_output: !header.tensors.iter().any(|t| t.name == "output.weight"),
    };
    for (i, t) in order.iter().enumerate() {
        let end = order.get(i + 1).map(|n| n.offset).unwrap_or(data_len);
        let size = end.saturating_sub(t.offset);
        let block = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next()?.parse::<usize>().ok());
        match block {
            Some(b) if b < n_layer => out.blocks[b] += size,
            _ if t.name.starts_with("token_embd") => out.input += size,
            _ => out.output += size,
        }
    }
    out
}

/// One place the model's memory lands: this machine or a worker.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    /// `this machine`, or `RPC worker HOST:PORT`.
    pub place: String,
    /// The layers it holds (`n_layer` is the output layer).
    pub layers: Vec<usize>,
    pub weights: u64,
    pub kv: u64,
    pub compute: u64,
    pub free: u64,
    /// How the free memory was found, for the line.
    pub free_detail: String,
}

impl Part {
    fn need(&self) -> u64 {
        self.weights + self.kv + self.compute
    }

    fn fits(&self) -> bool {
        self.need().saturating_add(MARGIN_BYTES) <= self.free
    }

    fn describe(&self, n_layer: usize) -> String {
        let mut layers = layer_text(&self.layers, n_layer);
        if self.place == LOCAL {
            layers = if self.layers.is_empty() {
                "the input layer".to_string()
            } else {
                format!("the input layer and {layers}")
            };
        }
        format!(
            "{} needs {:.2} GiB ({}: weights {:.2} + KV {:.2} + compute {:.2}) of {:.2} GiB {}",
            self.place,
            gib(self.need()),
            layers,
            gib(self.weights),
            gib(self.kv),
            gib(self.compute),
            gib(self.free),
            self.free_detail
        )
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

/// "layers 0-14 of 30", "layers 15-29 of 30 and the output layer", "the input layer".
fn layer_text(layers: &[usize], n_layer: usize) -> String {
    let blocks: Vec<usize> = layers.iter().copied().filter(|l| *l < n_layer).collect();
    let output = layers.contains(&n_layer);
    let mut text = match (blocks.first(), blocks.last()) {
        (Some(a), Some(b)) if a == b => format!("layer {a} of {n_layer}"),
        (Some(a), Some(b)) => format!("layers {a}-{b} of {n_layer}"),
        _ => String::new(),
    };
    if output {
        text = if text.is_empty() {
            "the output layer".to_string()
        } else {
            format!("{text} and the output layer")
        };
    }
    if text.is_empty() {
        "no layers".to_string()
    } else {
        text
    }
}

/// How many layers the backend offers to devices: its last `-ngl` (llama.cpp takes the last of
/// a repeated flag, and arguments passed after `--` come after the route's; `all`/`auto` and
/// absent: every layer, as llama.cpp's fit does when the devices have room).
fn gpu_layers(argv: &[String], n_layer: usize) -> usize {
    let value = argv
        .iter()
        .rposition(|a| matches!(a.as_str(), "-ngl" | "--gpu-layers" | "--n-gpu-layers"))
        .and_then(|i| argv.get(i + 1));
    match value.map(String::as_str) {
        Some(n) => n.parse::<usize>().unwrap_or(n_layer + 1),
        None => n_layer + 1,
    }
}

/// Split `need` over this machine and the workers as llama.cpp will. `local_free` is what
/// serve's own check reads for the plan's pool; a `gtt` pool is a GPU of this machine, listed
/// after the workers. Pure but for reading the model's header.
pub fn parts(
    model: &Path,
    n_layer: usize,
    n_gpu_layers: usize,
    need: &MemoryNeed,
    offers: &[Offer],
    local_free: &admission::Free,
) -> Vec<Part> {
    // llama.cpp's device list: each worker's devices, then this machine's GPU.
    let mut owner: Vec<usize> = Vec::new();
    let mut device_free: Vec<u64> = Vec::new();
    for (w, offer) in offers.iter().enumerate() {
        for d in &offer.devices {
            owner.push(w + 1);
            device_free.push(d.free);
        }
    }
    if need.pool == "gtt" {
        owner.push(0);
        device_free.push(local_free.bytes);
    }
    let homes = assign(n_layer, n_gpu_layers, &device_free);
    let weights = layer_weights(model, n_layer, need.weights_bytes);
    let kv_per_layer = need.kv_bytes / n_layer.max(1) as u64;

    let mut parts: Vec<Part> = std::iter::once(Part {
        place: LOCAL.to_string(),
        layers: Vec::new(),
        weights: weights.input,
        kv: 0,
        compute: need.compute_bytes,
        free: local_free.bytes,
        free_detail: format!("free {}", local_free.detail),
    })
    .chain(offers.iter().map(|o| Part {
        place: format!("RPC worker {}", o.endpoint),
        layers: Vec::new(),
        weights: 0,
        kv: 0,
        compute: 0,
        free: o.free(),
        free_detail: "it offers".to_string(),
    }))
    .collect();
    for (il, home) in homes.iter().enumerate() {
        let at = match home {
            Home::Cpu => 0,
            Home::Device(d) => owner[*d],
        };
        let part = &mut parts[at];
        part.layers.push(il);
        if il < n_layer {
            part.weights += weights.blocks[il];
            part.kv += kv_per_layer;
        } else {
            part.weights += weights.output;
            if weights.tied_output && at != 0 {
                part.weights += weights.input;
            }
        }
    }
    // Every worker that holds layers runs its part of the graph in a compute buffer of its own.
    for part in parts.iter_mut().skip(1).filter(|p| !p.layers.is_empty()) {
        part.compute = need.compute_bytes;
    }
    parts
}

/// The check's outcome: whether every part fits, and the one line that says so or names
/// where it does not. Pure.
pub fn judge(name: &str, parts: &[Part], n_layer: usize) -> (bool, String) {
    let workers = parts.len() - 1;
    let short: Vec<&Part> = parts.iter().filter(|p| !p.fits()).collect();
    if short.is_empty() {
        let all: Vec<String> = parts.iter().map(|p| p.describe(n_layer)).collect();
        return (
            true,
            format!(
                "{name}: fits across this machine and {workers} RPC worker{}: {}",
                if workers == 1 { "" } else { "s" },
                all.join("; ")
            ),
        );
    }
    let places: Vec<String> = short
        .iter()
        .map(|p| p.place.trim_start_matches("RPC worker ").to_string())
        .collect();
    let said: Vec<String> = short.iter().map(|p| p.describe(n_layer)).collect();
    (
        false,
        format!(
            "{name} does not fit on {}: {}; add RPC workers or free memory there, lower --ctx-size, or pass --no-mem-check",
            places.join(" nor on "),
            said.join("; ")
        ),
    )
}

/// serve's memory check with `--rpc`: Some(exit status) for `--mem-check` (the line on
/// stdout), Err(exit 3) for a load that does not fit somewhere, None to go on (the line on
/// stderr). With no workers it does nothing, and serve's own check runs instead. Called on
/// serve's main thread before anything starts; reads /proc and the model's header.
pub fn admit(
    args: &ServeArgs,
    name: &str,
    plan: &Plan,
    offers: &[Offer],
) -> Result<Option<i32>, Fatal> {
    if offers.is_empty()
        || (!args.mem_check && admission::skipped(args.no_mem_check, args.env.no_mem_check()))
    {
        return Ok(None);
    }
    let Some(need) = &plan.memory else {
        return Ok(None);
    };
    let free = admission::free_for(need, &admission::Sources::from_env())?;
    let n_layer = gguf::read_header_lean(args.model())
        .ok()
        .and_then(|h| h.get_u64(&h.arch_key("block_count")?))
        .unwrap_or(1)
        .max(1) as usize;
    let argv = plan
        .backends
        .first()
        .map(|b| b.argv.as_slice())
        .unwrap_or_default();
    let parts = parts(
        args.model(),
        n_layer,
        gpu_layers(argv, n_layer),
        need,
        offers,
        &free,
    );
    let (fits, line) = judge(name, &parts, n_layer);
    if args.mem_check {
        println!("{line}");
        return Ok(Some(if fits { exit::OK } else { exit::NO_FIT }));
    }
    if !fits {
        return Err(Fatal {
            code: exit::NO_FIT,
            message: line,
        });
    }
    tracing::info!("1bit serve: {line}");
    Ok(None)
}

#[cfg(test)]
#[path = "split_tests.rs"]
mod tests;
