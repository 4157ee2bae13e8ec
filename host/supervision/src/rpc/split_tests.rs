use super::*;
use crate::rpc::probe::DeviceMemory;

const G: u64 = 1 << 30;

fn homes_per_device(homes: &[Home]) -> Vec<(Home, usize)> {
    let mut out: Vec<(Home, usize)> = Vec::new();
    for h in homes {
        match out.last_mut() {
            Some((last, n)) if last == h => *n += 1,
            _ => out.push((*h, 1)),
        }
    }
    out
}

#[test]
fn equal_workers_take_halves_as_llama_cpp_assigns_them() {
    // 30 blocks and the output over two devices with equal free memory: layer il goes to the
    // first device whose cumulative share exceeds il/31, so 0..=15 and 16..=30.
    let homes = assign(30, 31, &[8 * G, 8 * G]);
    assert_eq!(
        homes_per_device(&homes),
        [(Home::Device(0), 16), (Home::Device(1), 15)]
    );
}

#[test]
fn shares_follow_free_memory_and_layers_beyond_ngl_stay_on_the_cpu() {
    // 1:3 → the first device's share ends at 0.25: layers 0..=7 (7/31 < 0.25 <= 8/31).
    let homes = assign(30, 31, &[G, 3 * G]);
    assert_eq!(
        homes_per_device(&homes),
        [(Home::Device(0), 8), (Home::Device(1), 23)]
    );
    // -ngl 11: the first 20 layers stay here, the last 11 (10 blocks and the output) go out.
    let homes = assign(30, 11, &[G, G]);
    assert_eq!(
        homes_per_device(&homes),
        [(Home::Cpu, 20), (Home::Device(0), 6), (Home::Device(1), 5)]
    );
    // -ngl 0: everything here.
    assert!(assign(30, 0, &[G]).iter().all(|h| *h == Home::Cpu));
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("onebit-split-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{name}.gguf"))
}

#[test]
fn layer_weights_come_from_the_tensor_table() {
    let path = temp("tensors");
    // token_embd 1000 bytes, two blocks of 300 each (two tensors), no output.weight: tied.
    gguf::writer::Builder::new()
        .kv("general.architecture", "llama")
        .kv("llama.block_count", 2u32)
        .tensor("token_embd.weight", &[10, 10], 0, 0)
        .tensor("blk.0.attn_q.weight", &[10, 10], 0, 1000)
        .tensor("blk.0.ffn_up.weight", &[10, 10], 0, 1100)
        .tensor("blk.1.attn_q.weight", &[10, 10], 0, 1300)
        .tensor("output_norm.weight", &[10], 0, 1600)
        .write(&path)
        .unwrap();
    let header = gguf::read_header_lean(&path).unwrap();
    // Give the data section its 1640 bytes.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(header.data_offset + 1640).unwrap();
    let w = layer_weights(&path, 2, 1640);
    assert_eq!(
        w,
        LayerWeights {
            input: 1000,
            blocks: vec![300, 300],
            output: 40,
            tied_output: true,
        }
    );
}

fn offer(endpoint: &str, free_gib: u64) -> Offer {
    Offer {
        endpoint: endpoint.to_string(),
        version: (7, 0, 0),
        devices: vec![DeviceMemory {
            free: free_gib * G,
            total: free_gib * G,
        }],
    }
}

fn need(weights: u64, kv: u64) -> MemoryNeed {
    MemoryNeed {
        weights_bytes: weights,
        kv_bytes: kv,
        compute_bytes: G / 2,
        ctx: 4096,
        ctx_source: "ctx 4096 (--ctx-size)".into(),
        pool: "ram".into(),
        llama_kv: None,
        device: None,
    }
}

fn local(gib_free: u64) -> admission::Free {
    admission::Free {
        bytes: gib_free * G,
        detail: format!("(MemAvailable {gib_free}.0 GiB)"),
        gtt_used: None,
    }
}

#[test]
fn a_large_sparse_model_is_refused_naming_the_worker_that_holds_the_output() {
    // 30 blocks of 1 GiB and 8 GiB of token embeddings, tied (no output.weight): llama.cpp
    // gives the device that holds the output layer its own copy of them. Workers offering 64
    // and 16 GiB split the layers 0.8 : 0.2, so the second takes blocks 25-29 and the output,
    // and with them the 8 GiB copy: more than its share, and more than it has.
    let path = temp("large");
    let mut b =
        gguf::writer::Builder::smollm2_shaped().tensor("token_embd.weight", &[576, 49152], 0, 0);
    for i in 0..30u64 {
        b = b.tensor(
            format!("blk.{i}.ffn_up.weight"),
            &[576, 1536],
            0,
            8 * G + i * G,
        );
    }
    b.tensor("output_norm.weight", &[576], 0, 38 * G)
        .total_size(38 * G + (1 << 20))
        .write(&path)
        .unwrap();
    let parts = parts(
        &path,
        30,
        31,
        &need(38 * G, 15 * G),
        &[offer("10.77.1.2:50052", 64), offer("10.77.2.2:50052", 16)],
        &local(16),
    );
    assert_eq!(parts.len(), 3);
    assert_eq!(
        parts[0].layers,
        Vec::<usize>::new(),
        "only the input layer stays here"
    );
    assert_eq!(parts[0].weights, 8 * G);
    assert_eq!(parts[1].layers, (0..=24).collect::<Vec<_>>());
    assert_eq!(parts[2].layers, (25..=30).collect::<Vec<_>>());
    let (fits, line) = judge("big", &parts, 30);
    assert!(!fits);
    assert!(
        line.starts_with("big does not fit on 10.77.2.2:50052: RPC worker 10.77.2.2:50052 needs 16.00 GiB (layers 25-29 of 30 and the output layer: weights 13.00 + KV 2.50 + compute 0.50) of 16.00 GiB it offers"),
        "{line}"
    );
    assert!(line.ends_with("pass --no-mem-check"), "{line}");
    assert!(
        !line.contains("10.77.1.2"),
        "the worker that fits is not named: {line}"
    );
}

#[test]
fn a_header_only_model_is_spread_evenly_and_fits_in_one_line() {
    let path = temp("even");
    gguf::writer::Builder::smollm2_shaped()
        .total_size(31 * G)
        .write(&path)
        .unwrap();
    let parts = parts_for(
        &path,
        &[offer("10.77.1.2:50052", 64), offer("10.77.2.2:50052", 64)],
    );
    let (fits, line) = judge("big", &parts, 30);
    assert!(fits, "{line}");
    assert!(line.starts_with("big: fits across this machine and 2 RPC workers: this machine needs 0.50 GiB (the input layer:"), "{line}");
    assert!(line.contains("RPC worker 10.77.1.2:50052 needs 32.50 GiB (layers 0-15 of 30: weights 16.00 + KV 16.00 + compute 0.50) of 64.00 GiB it offers"), "{line}");
    assert!(
        line.contains(
            "RPC worker 10.77.2.2:50052 needs 29.50 GiB (layers 16-29 of 30 and the output layer"
        ),
        "{line}"
    );
}

fn parts_for(path: &Path, offers: &[Offer]) -> Vec<Part> {
    parts(path, 30, 31, &need(31 * G, 30 * G), offers, &local(8))
}

#[test]
fn the_local_part_is_refused_on_its_own() {
    // -ngl 0 keeps every layer here, whatever the workers offer.
    let path = temp("local");
    gguf::writer::Builder::smollm2_shaped()
        .total_size(31 * G)
        .write(&path)
        .unwrap();
    let parts = parts(
        &path,
        30,
        0,
        &need(31 * G, G),
        &[offer("h:1", 512)],
        &local(8),
    );
    let (fits, line) = judge("m", &parts, 30);
    assert!(!fits);
    assert!(
        line.starts_with("m does not fit on this machine: this machine needs"),
        "{line}"
    );
}

#[test]
fn the_last_ngl_counts_as_llama_cpp_takes_it() {
    let argv: Vec<String> = ["llama-server", "-ngl", "all", "-c", "1", "-ngl", "11"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(gpu_layers(&argv, 30), 11);
    assert_eq!(gpu_layers(&argv[..3], 30), 31);
    assert_eq!(gpu_layers(&argv[..1], 30), 31);
}
