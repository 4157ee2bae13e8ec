//! What a model can ask for: --parallel, drafting, --mmproj, roles, --precise, thinking
//! controls; the argv and env each gives per route, the refusals, and the real effect.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use onebit_tests::*;

/// A header-only GGUF of `arch` with enough shape for the memory check, plus `extra` keys.
fn model(dir: &Path, name: &str, arch: &str, extra: &[(&str, u32)]) -> PathBuf {
    let path = dir.join(name);
    let mut b = gguf::writer::Builder::new()
        .kv("general.architecture", arch)
        .kv(format!("{arch}.block_count"), 2u32)
        .kv(format!("{arch}.context_length"), 4096u32)
        .kv(format!("{arch}.embedding_length"), 64u32)
        .kv(format!("{arch}.attention.head_count"), 4u32);
    for (k, v) in extra {
        b = b.kv(*k, *v);
    }
    b.write(&path).unwrap();
    path
}

/// `1bit serve ... --print-backend` on port 8001 with a clean environment plus `env`:
/// (exit status, the plan's JSON or null, stderr).
fn plan(
    model: &Path,
    device: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (i32, serde_json::Value, String) {
    let mut command = Command::new(onebit());
    command
        .args(["serve", "-m", model.to_str().unwrap(), "--device", device])
        .args(["--llama-server", fake_backend().to_str().unwrap()])
        .args(["--port", "8001", "--print-backend"])
        .args(extra);
    for (k, _) in std::env::vars() {
        if k.starts_with("GGML_HRX_") || k.starts_with("ONEBIT_") {
            command.env_remove(k);
        }
    }
    command
        .env("ONEBIT_HRX_PRESENT", "1")
        .envs(env.iter().copied());
    let out = command.output().unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (
        out.status.code().unwrap_or(-1),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn argv(plan: &serde_json::Value) -> String {
    plan["argv"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

#[test]
fn parallel_gives_slots_and_on_hrx_a_shared_cache_without_the_qwen_attention_dispatch() {
    let dir = temp_dir("parallel");
    let m = model(&dir, "q.gguf", "qwen3", &[]);
    let (code, p, err) = plan(&m, "cpu", &["--parallel", "3"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        argv(&p).contains("-np 3") && !argv(&p).contains("-kvu"),
        "{}",
        argv(&p)
    );

    let (code, p, err) = plan(&m, "hrx", &["--parallel", "3"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(argv(&p).contains("-np 3 -kvu"), "{}", argv(&p));
    assert_eq!(p["env"]["GGML_HRX_DISABLE_DISPATCH"], "qwen.attention");

    let (_, p, _) = plan(
        &m,
        "hrx",
        &["--parallel", "3"],
        &[("GGML_HRX_DISABLE_DISPATCH", "foo.bar")],
    );
    assert_eq!(
        p["env"]["GGML_HRX_DISABLE_DISPATCH"], "foo.bar,qwen.attention",
        "appended to the user's own value"
    );
}

#[test]
fn gated_delta_net_models_get_one_slot_on_hrx_and_keep_theirs_on_cpu() {
    let dir = temp_dir("gdn");
    let m = model(
        &dir,
        "q35.gguf",
        "qwen35",
        &[("qwen35.full_attention_interval", 4)],
    );
    let (code, _, err) = plan(&m, "hrx", &["--parallel", "2"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("HRX runs one gated delta-net sequence at a time"),
        "{err}"
    );

    let (code, p, err) = plan(&m, "auto", &["--parallel", "2"], &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(p["device"], "hrx");
    assert!(argv(&p).contains("-np 1"), "{}", argv(&p));
    assert!(
        err.contains("HRX runs one gated delta-net sequence at a time"),
        "{err}"
    );

    let (code, p, err) = plan(&m, "cpu", &["--parallel", "2"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(argv(&p).contains("-np 2"), "{}", argv(&p));
}

#[test]
fn drafting_flags_map_to_llama_servers_speculative_options() {
    let dir = temp_dir("draft");
    let m = model(&dir, "q.gguf", "qwen3", &[]);
    let head = model(&dir, "head.gguf", "qwen3", &[]);
    let head_s = head.to_str().unwrap();
    let (code, p, err) = plan(&m, "cpu", &["--mtp", head_s], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        argv(&p).contains(&format!("--spec-type draft-mtp -md {head_s} -ngld 99")),
        "{}",
        argv(&p)
    );

    let block = dir.join("dflash.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "dflash")
        .kv("dflash.block_size", 8u32)
        .write(&block)
        .unwrap();
    let block_s = block.to_str().unwrap();
    let (_, p, _) = plan(&m, "cpu", &["--dflash", block_s], &[]);
    assert!(
        argv(&p).contains(&format!(
            "--spec-type draft-dflash -md {block_s} -ngld 99 --spec-draft-n-max 7"
        )),
        "{}",
        argv(&p)
    );
    let (_, p, _) = plan(&m, "cpu", &["--dflash", head_s], &[]);
    assert!(
        argv(&p).contains("--spec-draft-n-max 16"),
        "no block size: 16: {}",
        argv(&p)
    );
    let (_, p, _) = plan(
        &m,
        "cpu",
        &["--dflash", block_s, "--mtp-max", "4", "--mtp-p-min", "0.5"],
        &[],
    );
    let a = argv(&p);
    assert!(
        a.contains("--spec-draft-n-max 4") && a.contains("--spec-draft-p-min 0.5"),
        "{a}"
    );
    assert_eq!(a.matches("--spec-draft-n-max").count(), 1, "{a}");

    let (code, _, err) = plan(&m, "cpu", &["--mtp", head_s, "--dflash", block_s], &[]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--mtp and --dflash are two drafters; pick one"),
        "{err}"
    );
    let (code, _, err) = plan(&m, "cpu", &["--mtp-max", "4"], &[]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = plan(&m, "cpu", &["--mtp", "/nonexistent/head.gguf"], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("--mtp /nonexistent/head.gguf"), "{err}");
}

#[test]
fn a_model_with_its_own_mtp_layers_drafts_with_them_on_hrx_unless_told_not_to() {
    let dir = temp_dir("nextn");
    let m = model(
        &dir,
        "q.gguf",
        "qwen3",
        &[("qwen3.nextn_predict_layers", 1)],
    );
    let (_, p, _) = plan(&m, "hrx", &[], &[]);
    let a = argv(&p);
    assert!(
        a.contains("--spec-type draft-mtp") && !a.contains("-md "),
        "{a}"
    );
    for (extra, env) in [
        (vec!["--no-mtp"], vec![]),
        (vec![], vec![("ONEBIT_NO_MTP", "1")]),
        (vec!["--parallel", "2"], vec![]),
        (vec!["--embedding"], vec![]),
    ] {
        let (code, p, err) = plan(&m, "hrx", &extra, &env);
        assert_eq!(code, 0, "{err}");
        assert!(
            !argv(&p).contains("draft-mtp"),
            "{extra:?} {env:?}: {}",
            argv(&p)
        );
    }
    let (_, p, _) = plan(&m, "cpu", &[], &[]);
    assert!(!argv(&p).contains("draft-mtp"), "not on cpu: {}", argv(&p));
}

/// A recipes file with one recipe per drafter, each adding its own flag.
const DRAFTER_RECIPES: &str = r#"{"about":"a recipe per drafter","recipes":[
    {"id":"plain","match":{"drafter":["none"]},"args":["--for-none"],"measured":"m"},
    {"id":"mtp","match":{"drafter":["mtp"]},"args":["--for-mtp"],"measured":"m"},
    {"id":"dflash","match":{"drafter":["dflash"]},"args":["--for-dflash"],"measured":"m"}
]}"#;

/// The recipes of [`DRAFTER_RECIPES`] that `plan` applied, by their flags.
fn drafter_recipes(p: &serde_json::Value) -> Vec<&'static str> {
    let a = argv(p);
    let words = a.split(' ').collect::<Vec<_>>();
    ["--for-none", "--for-mtp", "--for-dflash"]
        .into_iter()
        .filter(|flag| words.contains(flag))
        .collect()
}

#[test]
fn a_recipe_matches_the_drafter_serve_runs_the_models_own_mtp_layers_included() {
    let dir = temp_dir("drafter-recipes");
    let recipes = dir.join("recipes.json");
    std::fs::write(&recipes, DRAFTER_RECIPES).unwrap();
    let recipes = recipes.to_str().unwrap();
    let m = model(&dir, "q.gguf", "qwen3", &[]);
    let own = model(
        &dir,
        "own.gguf",
        "qwen3",
        &[("qwen3.nextn_predict_layers", 1)],
    );
    let head = model(&dir, "head.gguf", "qwen3", &[]);
    let draft = model(&dir, "draft.gguf", "qwen3", &[]);
    let (head, draft) = (head.to_str().unwrap(), draft.to_str().unwrap());
    for (model, extra, drafter) in [
        (&m, vec![], "--for-none"),
        (&m, vec!["--mtp", head], "--for-mtp"),
        (&m, vec!["--dflash", draft], "--for-dflash"),
        // On HRX a model with MTP layers of its own drafts with them: an mtp drafter.
        (&own, vec![], "--for-mtp"),
        (&own, vec!["--no-mtp"], "--for-none"),
    ] {
        let mut args = vec!["--recipes", recipes];
        args.extend(&extra);
        let (code, p, err) = plan(model, "hrx", &args, &[]);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert_eq!(drafter_recipes(&p), [drafter], "{extra:?}: {}", argv(&p));
    }
}

#[test]
fn mmproj_and_roles_set_their_batches() {
    let dir = temp_dir("mmproj");
    let m = model(&dir, "q.gguf", "qwen3", &[]);
    let proj = model(&dir, "mmproj.gguf", "clip", &[]);
    let proj_s = proj.to_str().unwrap();
    for device in ["cpu", "hrx"] {
        let (code, p, err) = plan(&m, device, &["--mmproj", proj_s], &[]);
        assert_eq!(code, 0, "{err}");
        assert!(
            argv(&p).contains(&format!("--mmproj {proj_s} -b 4096 -ub 4096")),
            "{}",
            argv(&p)
        );
    }
    let (_, p, _) = plan(&m, "cpu", &["--embedding"], &[]);
    let a = argv(&p);
    assert!(
        a.contains("-c 8192") && a.contains("--embedding -b 8192 -ub 8192"),
        "{a}"
    );
    let (_, p, _) = plan(&m, "cpu", &["--reranking", "-c", "2048"], &[]);
    assert!(
        argv(&p).contains("--reranking -b 2048 -ub 2048"),
        "{}",
        argv(&p)
    );
}

#[test]
fn the_drafter_and_the_side_servers_count_in_the_memory_check() {
    let dir = temp_dir("draft-memory");
    let m = model(&dir, "q.gguf", "qwen3", &[]);
    let head = dir.join("head.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "qwen3")
        .total_size(3 << 30)
        .write(&head)
        .unwrap();
    let check = |extra: &[&str]| {
        let out = Command::new(onebit())
            .args([
                "serve",
                "-m",
                m.to_str().unwrap(),
                "--device",
                "cpu",
                "--mem-check",
            ])
            .args(["--llama-server", fake_backend().to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(check(&[]).contains("weights 0.00 +"), "{}", check(&[]));
    let with = check(&["--mtp", head.to_str().unwrap()]);
    assert!(with.contains("weights 3.00 +"), "{with}");
    let with = check(&["--embed", head.to_str().unwrap()]);
    assert!(
        with.contains("weights 3.00 +"),
        "a side server counts: {with}"
    );
}

#[test]
fn thinking_controls_and_precise_reach_the_backend() {
    let dir = temp_dir("thinking");
    let m = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(
        &m,
        &["--precise"],
        &[("FAKE_RECORD", record.to_str().unwrap())],
    );
    serve.ready();
    let body = r#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false},"reasoning_format":"none"}"#;
    assert_eq!(post(&serve.url("/v1/chat/completions"), body).0, 200);
    let sent = json_lines(&record)
        .into_iter()
        .find(|l| l["path"] == "/v1/chat/completions")
        .expect("the chat reached the backend");
    let sent: serde_json::Value = serde_json::from_str(sent["body"].as_str().unwrap()).unwrap();
    assert_eq!(sent["chat_template_kwargs"]["enable_thinking"], false);
    assert_eq!(sent["reasoning_format"], "none");
    assert_eq!(sent["cache_prompt"], false, "--precise");
}

/// Serve SmolLM2 on the real llama-server with `extra` flags.
fn smollm2(extra: &[&str]) -> Serve {
    serve_smollm2(extra)
}

#[test]
fn two_slots_decode_two_chats_at_once() {
    let serve = smollm2(&["--parallel", "2", "--ctx-size", "2048"]);
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "temperature": 0,
        "max_tokens": 48,
    })
    .to_string();
    let url = serve.url("/v1/chat/completions");
    let slots_url = serve.url("/slots");
    let (replies, most_busy) = std::thread::scope(|s| {
        let a = s.spawn(|| post(&url, &body));
        let b = s.spawn(|| post(&url, &body));
        let mut most_busy = 0;
        while !a.is_finished() || !b.is_finished() {
            let (_, slots) = get(&slots_url);
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&slots) {
                let busy = v
                    .as_array()
                    .map(|a| a.iter().filter(|s| s["is_processing"] == true).count())
                    .unwrap_or(0);
                most_busy = most_busy.max(busy);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        ((a.join().unwrap(), b.join().unwrap()), most_busy)
    });
    for (status, reply) in [replies.0, replies.1] {
        assert_eq!(status, 200, "{reply}");
        assert!(reply.contains("Paris"), "{reply}");
    }
    assert_eq!(most_busy, 2, "both chats were decoding at the same time");
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn the_model_itself_serves_embeddings_that_rank_a_paraphrase_first() {
    let serve = smollm2(&["--embedding"]);
    let body = serde_json::json!({"input": [
        "The cat sat on the mat.",
        "A cat was sitting on the rug.",
        "Quarterly revenue grew by four percent.",
    ]});
    let (status, reply) = post(&serve.url("/v1/embeddings"), &body.to_string());
    assert_eq!(status, 200, "{reply}");
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    let vectors: Vec<Vec<f64>> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(vectors.len(), 3);
    assert!(
        vectors.iter().all(|e| e.len() == 576),
        "SmolLM2's width is 576"
    );
    let paraphrase = cosine(&vectors[0], &vectors[1]);
    let unrelated = cosine(&vectors[0], &vectors[2]);
    assert!(paraphrase > unrelated, "{paraphrase} vs {unrelated}");
}

#[test]
fn precise_prefills_a_repeated_request_whole_and_without_it_the_cache_serves_it() {
    let ask = |serve: &Serve| {
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
            "temperature": 0,
            "max_tokens": 4,
        })
        .to_string();
        let (status, reply) = post(&serve.url("/v1/chat/completions"), &body);
        assert_eq!(status, 200, "{reply}");
        let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
        (
            v["timings"]["prompt_n"].as_u64().unwrap(),
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
        )
    };
    let serve = smollm2(&["--precise", "--parallel", "1"]);
    let _ = ask(&serve);
    let (prompt_n, prompt_tokens) = ask(&serve);
    assert_eq!(
        prompt_n, prompt_tokens,
        "--precise prefills the whole prompt again"
    );
    drop(serve);
    let serve = smollm2(&["--parallel", "1"]);
    let _ = ask(&serve);
    let (prompt_n, prompt_tokens) = ask(&serve);
    assert!(
        prompt_n < prompt_tokens,
        "served from the cache: {prompt_n} of {prompt_tokens}"
    );
}

/// The argv of each of serve's backends, in start order.
fn backend_argvs(serve: &Serve) -> Vec<Vec<String>> {
    let mut children = serve.children();
    children.sort();
    children
        .iter()
        .map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .split('\0')
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect()
        })
        .collect()
}

#[test]
fn embed_and_rerank_servers_run_beside_the_chat_model_and_get_their_routes() {
    let dir = temp_dir("rag");
    let chat = dummy_model(&dir, "chat.gguf");
    let embed = dummy_model(&dir, "embedder.gguf");
    let rerank = dummy_model(&dir, "ranker.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(
        &chat,
        &[
            "--embed",
            embed.to_str().unwrap(),
            "--rerank",
            rerank.to_str().unwrap(),
        ],
        &[("FAKE_RECORD", record.to_str().unwrap())],
    );
    serve.ready();
    let argvs = backend_argvs(&serve);
    assert_eq!(argvs.len(), 3, "{argvs:?}");
    let joined: Vec<String> = argvs.iter().map(|a| a.join(" ")).collect();
    let side = |needle: &str| joined.iter().find(|a| a.contains(needle)).cloned().unwrap();
    assert!(side("embedder.gguf").contains("--embedding -c 8192 -b 8192 -ub 8192 -np 4"));
    assert!(side("ranker.gguf").contains("--reranking -c 8192 -b 8192 -ub 8192 -np 4"));
    let port_of = |a: &str| {
        let words: Vec<&str> = a.split(' ').collect();
        let i = words.iter().position(|w| *w == "--port").unwrap();
        words[i + 1].to_string()
    };
    let (embed_port, rerank_port) = (
        port_of(&side("embedder.gguf")),
        port_of(&side("ranker.gguf")),
    );

    assert_eq!(
        post(&serve.url("/v1/embeddings"), r#"{"input":"hello"}"#).0,
        200
    );
    assert_eq!(
        post(
            &serve.url("/v1/rerank"),
            r#"{"query":"a","documents":["a","b"]}"#
        )
        .0,
        200
    );
    assert_eq!(
        post(
            &serve.url("/v1/chat/completions"),
            r#"{"messages":[{"role":"user","content":"hi"}]}"#
        )
        .0,
        200
    );
    let hosts: Vec<(String, String)> = json_lines(&record)
        .iter()
        .filter(|l| l["method"] == "POST")
        .map(|l| {
            (
                l["path"].as_str().unwrap_or("").to_string(),
                l["headers"]["host"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let host_of = |path: &str| {
        hosts
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, h)| h.clone())
            .unwrap()
    };
    assert!(
        host_of("/v1/embeddings").ends_with(&format!(":{embed_port}")),
        "{hosts:?}"
    );
    assert!(
        host_of("/v1/rerank").ends_with(&format!(":{rerank_port}")),
        "{hosts:?}"
    );
    assert!(!host_of("/v1/chat/completions").ends_with(&format!(":{embed_port}")));

    let (_, models) = get(&serve.url("/v1/models"));
    let v: serde_json::Value = serde_json::from_str(&models).unwrap();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 3, "{models}");
    assert_eq!(data[1]["id"], "embedder");
    assert_eq!(data[1]["role"], "embedding");
    assert_eq!(data[2]["id"], "ranker");
    assert_eq!(data[2]["role"], "rerank");
}

#[test]
fn a_real_embedding_server_answers_beside_the_real_chat_model() {
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let serve = smollm2(&["--ctx-size", "2048", "--embed", model.to_str().unwrap()]);
    let chat = serde_json::json!({
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "temperature": 0,
        "max_tokens": 8,
    })
    .to_string();
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &chat);
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains("Paris"), "{reply}");
    let (status, reply) = post(&serve.url("/v1/embeddings"), r#"{"input":"hello world"}"#);
    assert_eq!(status, 200, "{reply}");
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 576);
    let (_, models) = get(&serve.url("/v1/models"));
    assert!(models.contains(r#""role":"embedding""#), "{models}");
}

#[test]
fn hrx_side_servers_run_under_the_same_strict_placement() {
    let dir = temp_dir("rag-hrx");
    let chat = dummy_model(&dir, "chat.gguf");
    let embed = dummy_model(&dir, "embedder.gguf");
    let fake = fake_backend();
    let serve = Serve::start(
        &[
            "-m",
            chat.to_str().unwrap(),
            "--device",
            "hrx",
            "--llama-server",
            fake.to_str().unwrap(),
            "--embed",
            embed.to_str().unwrap(),
        ],
        &[],
    );
    serve.ready();
    let children = serve.children();
    assert_eq!(children.len(), 2);
    for pid in children {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        let text = String::from_utf8_lossy(&environ);
        assert!(
            text.split('\0').any(|v| v == "GGML_HRX_STRICT=1"),
            "pid {pid}"
        );
    }
}
