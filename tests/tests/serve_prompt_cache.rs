//! The persistent prompt cache (`--prompt-cache-dir`, issue 29) with the real, pinned
//! llama-server and SmolLM2 on the cpu route: a prefix saved by one serve is restored by the
//! next and answers exactly as a cold prefill; a state of another model or ctx is never used,
//! said once and left in the folder; a truncated or corrupt file is discarded with its line and
//! the request still answers; the budget evicts the least recently used; a read-only or full
//! directory leaves serving alone; `--precise` and `--no-prompt-cache` never restore; bad flags
//! exit 2 with one line; a save cut by the stop leaves no temporary file. Serves sharing a
//! folder: serve_prompt_cache_fleet.rs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;
use onebit_tests::prompt_cache_chats::*;
use onebit_tests::*;
use serde_json::{Value, json};

fn chat_body(topic: &str, stream: bool) -> Value {
    json!({
        "messages": first_turn(topic),
        "temperature": 0,
        "max_tokens": 24,
        "stream": stream,
    })
}

/// A greedy chat's whole reply.
fn chat(serve: &Serve, topic: &str) -> Value {
    let (status, reply) = post(
        &serve.url("/v1/chat/completions"),
        &chat_body(topic, false).to_string(),
    );
    assert_eq!(status, 200, "{reply}\n{}", serve.output());
    serde_json::from_str(&reply).unwrap()
}

/// A streamed greedy chat: its text and the last event's `timings`.
fn streamed(serve: &Serve, topic: &str) -> (String, Value) {
    let events = sse(
        &serve.url("/v1/chat/completions"),
        &chat_body(topic, true).to_string(),
    );
    let values: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let text = values
        .iter()
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str())
        .collect();
    let timings = values
        .iter()
        .rev()
        .find_map(|v| v.get("timings").cloned())
        .unwrap_or(Value::Null);
    (text, timings)
}

fn serve_with(dir: &Path, extra: &[&str]) -> Serve {
    serve_with_env(dir, extra, &[])
}

fn serve_with_env(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Serve {
    let mut args = vec![
        "--ctx-size",
        "2048",
        "--prompt-cache-dir",
        dir.to_str().unwrap(),
        "--prompt-cache-min-tokens",
        MIN_TOKENS,
    ];
    args.extend_from_slice(extra);
    serve_cpu_with_env(
        &installed_model("SmolLM2-135M-Instruct-Q4_1.gguf"),
        &args,
        env,
    )
}

/// The state files in a cache directory.
fn states(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| p.extension().is_some_and(|e| e == "state"));
    v.sort();
    v
}

/// The cache's series as `/metrics` shows them.
fn series(serve: &Serve, name: &str, labels: &[(&str, &str)]) -> f64 {
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200);
    sample(&parse_prometheus(&text), name, labels).unwrap_or(-1.0)
}

/// A cache directory holding the state one conversation (`topic`) left, and its cold reply.
fn saved(name: &str, topic: &str, extra: &[&str]) -> (PathBuf, Value) {
    let dir = temp_dir(name);
    let serve = serve_with(&dir, extra);
    let cold = chat(&serve, topic);
    stop(serve);
    assert_eq!(
        states(&dir).len(),
        1,
        "one state saved in {}",
        dir.display()
    );
    (dir, cold)
}

#[test]
fn a_restored_prefix_answers_exactly_as_a_cold_prefill_across_a_restart() {
    let _turn = one_at_a_time();
    let (dir, cold) = saved("pc-restart", "ships", &[]);
    assert!(cold["timings"].get("cache").is_none(), "{cold}");
    let prompt_tokens = cold["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 256, "the prompt is long enough: {cold}");
    for state in states(&dir) {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", state.display());
    }

    let serve = serve_with(&dir, &[]);
    let warm = chat(&serve, "ships");
    assert_eq!(text(&warm), text(&cold), "the same greedy reply");
    // The restore stops at the last micro-batch boundary (llama-server's -ub, 512) before the
    // prompt's end; the rest is prefilled in the run a cold prefill decodes it in.
    let restored = (prompt_tokens - 1) / UBATCH * UBATCH;
    let cache = &warm["timings"]["cache"];
    assert_eq!(cache["source"], "disk", "{warm}");
    assert_eq!(cache["n"].as_u64(), Some(restored), "{warm}");
    assert_eq!(
        warm["timings"]["cache_n"].as_u64(),
        Some(restored),
        "{warm}"
    );
    assert_eq!(
        warm["timings"]["prompt_n"].as_u64(),
        Some(prompt_tokens - restored),
        "{warm}"
    );
    assert_eq!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(restored),
        "{warm}"
    );
    assert_eq!(
        count(&serve.output(), "prompt cache: restored"),
        1,
        "{}",
        serve.output()
    );
    assert_eq!(
        series(&serve, "onebit_prompt_cache_restores_total", &[]),
        1.0
    );
    let restored_bytes = series(&serve, "onebit_prompt_cache_restored_bytes_total", &[]);
    assert_eq!(
        restored_bytes,
        std::fs::metadata(&states(&dir)[0]).unwrap().len() as f64
    );
    // The client's own slot actions answer as the specification says.
    let (status, reply) = post(
        &serve.url("/slots/0?action=save"),
        r#"{"filename":"mine.bin"}"#,
    );
    assert_eq!(status, 501, "{reply}");
    stop(serve);

    // Streamed, after another restart: the same text, and the last event says the disk.
    let serve = serve_with(&dir, &[]);
    let (text_streamed, timings) = streamed(&serve, "ships");
    assert_eq!(text_streamed, text(&cold));
    assert_eq!(timings["cache"]["source"], "disk", "{timings}");
    stop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// How many tokens the backend makes of a chat's templated prompt.
fn prompt_tokens(serve: &Serve, messages: &Value) -> u64 {
    let (status, templated) = post(
        &serve.url("/apply-template"),
        &json!({ "messages": messages }).to_string(),
    );
    assert_eq!(status, 200, "{templated}");
    let prompt = serde_json::from_str::<Value>(&templated).unwrap()["prompt"].clone();
    let (status, tokens) = post(
        &serve.url("/tokenize"),
        &json!({"content": prompt, "add_special": true, "parse_special": true}).to_string(),
    );
    assert_eq!(status, 200, "{tokens}");
    serde_json::from_str::<Value>(&tokens).unwrap()["tokens"]
        .as_array()
        .unwrap()
        .len() as u64
}

/// The first turn's reply was decoded a token at a time and its prompt's last micro-batch was
/// a short one: of its state, only the prompt's whole micro-batches are what a cold prefill
/// computes. The second turn shares the prompt and the reply with that state, past the next
/// micro-batch boundary; the restore still stops at the first turn's last whole micro-batch,
/// and the reply is the cold one's. A second turn served from llama-server's memory (the same
/// serve) began its prefill where that memory ended, so its state is not saved.
#[test]
fn a_restore_stops_at_the_first_turns_last_whole_micro_batch() {
    let _turn = one_at_a_time();
    let dir = temp_dir("pc-boundary");
    let serve = serve_with(&dir, &[]);
    // The first turn's prompt ends 1 to 8 tokens short of a micro-batch boundary, so a
    // reply of more than 8 tokens carries what the turns share across it.
    let first_turn = |pad: usize| {
        json!([
            {"role": "system", "content": format!("{}{}", system("rivers"), " Be kind.".repeat(pad))},
            {"role": "user", "content": "Tell me about item 7 and its colour in two sentences."},
        ])
    };
    let (first, p1) = (0..200)
        .map(first_turn)
        .map(|m| {
            let p = prompt_tokens(&serve, &m);
            (m, p)
        })
        .find(|(_, p)| p % UBATCH >= UBATCH - 8)
        .expect("a padding that ends the prompt just short of a boundary");
    let reply1 = chat_of(&serve, &first);
    let generated = reply1["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(generated > 8, "the reply crosses the boundary: {reply1}");
    let second = next_turn(&first, &reply1, "And item 8?");
    // The second turn in the same serve: llama-server reuses its memory of the first.
    let reused = chat_of(&serve, &second);
    assert!(
        reused["timings"]["cache_n"].as_u64().unwrap() > p1,
        "{reused}"
    );
    stop(serve);
    let descriptions: Vec<Value> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .map(|e| serde_json::from_str(&std::fs::read_to_string(e.path()).unwrap()).unwrap())
        .collect();
    assert_eq!(descriptions.len(), 1, "{descriptions:?}");
    let exact = p1 / UBATCH * UBATCH;
    assert_eq!(descriptions[0]["exact"].as_u64(), Some(exact));
    assert!(
        (descriptions[0]["tokens"].as_array().unwrap().len() as u64) < p1 + 30,
        "the first turn's state, not the second's"
    );

    let serve = serve_with(&dir, &[]);
    let warm = chat_of(&serve, &second);
    assert_eq!(
        warm["timings"]["cache"]["n"].as_u64(),
        Some(exact),
        "{warm}"
    );
    stop(serve);
    let serve = serve_cpu_with_env(
        &installed_model("SmolLM2-135M-Instruct-Q4_1.gguf"),
        &["--ctx-size", "2048", "--no-prompt-cache"],
        &[],
    );
    let cold = chat_of(&serve, &second);
    assert_eq!(text(&warm), text(&cold), "the cold reply, token for token");
    stop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A slot that held a short chat shares its template's first tokens with a long prompt, and
/// llama-server would reuse them: serve empties the slot first, so the long prompt is
/// prefilled from its first token, as a cold run does, and its state is saved.
#[test]
fn a_long_prompt_after_a_short_chat_on_its_slot_is_prefilled_whole_and_saved() {
    let _turn = one_at_a_time();
    let dir = temp_dir("pc-erase");
    let serve = serve_with(&dir, &[]);
    let short = json!({
        "messages": [{"role": "system", "content": "Rule 0 about ships: be brief."},
                     {"role": "user", "content": "Hello."}],
        "temperature": 0, "max_tokens": 4, "id_slot": 0,
    });
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &short.to_string());
    assert_eq!(status, 200, "{reply}");
    let mut long = chat_body("ships", false);
    long["id_slot"] = json!(0);
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &long.to_string());
    assert_eq!(status, 200, "{reply}");
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["timings"]["cache_n"].as_u64(), Some(0), "{reply}");
    stop(serve);
    assert_eq!(states(&dir).len(), 1, "the long prompt's state is saved");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two long conversations taking turns on one serve. llama-server (unified KV, `-np auto`)
/// empties every idle slot when another task starts (`--cache-idle-slots`, its default), so a
/// first turn's slot is empty when its second turn comes: serve reads that in `/slots` and
/// restores the first turn from the folder (it pinned the turn to the emptied slot, and the
/// prompt was prefilled whole), into a KV emptied as a cold prefill finds it, and the replies
/// are a cold serve's, token for token. With the user's `--no-cache-idle-slots` the slot keeps the
/// first turn for the second to reuse; the idle slots that keep their turns never starve a
/// prompt of the shared context (llama-server empties them for it), and a restore finds room
/// (serve empties the least recently used), so the next turns go on, from the folder where
/// their slot was emptied.
#[test]
fn two_conversations_taking_turns_each_find_their_first_turn() {
    let _turn = one_at_a_time();
    // A turn whose prompt begins with the first turn's: its reply, having found at least the
    // first turn's whole micro-batches, from the folder or not.
    let found = |serve: &Serve, turn: &Value, first_turn: &Value, from_disk: bool| {
        let reply = chat_of(serve, turn);
        let first_prompt = first_turn["usage"]["prompt_tokens"].as_u64().unwrap();
        let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            cached >= first_prompt / UBATCH * UBATCH && cached >= UBATCH,
            "the first turn's {first_prompt} tokens found: {reply}\n{}",
            serve.output()
        );
        assert_eq!(
            reply["timings"]["cache"]["source"] == "disk",
            from_disk,
            "{reply}\n{}",
            serve.output()
        );
        reply
    };
    for (extra, from_disk) in [
        (&[][..], true),
        (&["--", "--no-cache-idle-slots"][..], false),
    ] {
        let dir = temp_dir("pc-turns");
        let serve = serve_with(&dir, extra);
        let mut turns = Vec::new();
        for topic in ["ships", "rivers"] {
            let turn = first_turn(topic);
            let reply = chat_of(&serve, &turn);
            turns.push((turn, reply));
        }
        let seconds: Vec<(Value, Value)> = turns
            .iter()
            .map(|(turn, reply)| {
                // A long question: what is prefilled after the restore is computed in the
                // KV's layout. With 10 rules the reply of a restore beside the other
                // conversation's cells was seen to differ from the cold one (with 4, 6, 12
                // and 16 it did not).
                let question = format!("{} And item 8?", rules("questions", 10));
                let second = next_turn(turn, reply, &question);
                let warm = found(&serve, &second, reply, from_disk);
                (second, warm)
            })
            .collect();
        if from_disk {
            let cold = serve_cpu_with_env(
                &installed_model("SmolLM2-135M-Instruct-Q4_1.gguf"),
                &["--ctx-size", "2048", "--no-prompt-cache"],
                &[],
            );
            for (second, warm) in &seconds {
                assert_eq!(text(warm), text(&chat_of(&cold, second)), "{second}");
            }
            stop(cold);
        }
        if !from_disk {
            // Three topics' rules: more than the context has free beside the two idle slots.
            let long: String = ["oceans", "forests", "deserts"].map(system).join(" ");
            let reply = chat_of(
                &serve,
                &json!([{"role": "system", "content": long}, {"role": "user", "content": "Hi."}]),
            );
            assert!(
                reply["usage"]["prompt_tokens"].as_u64().unwrap() > 1_500,
                "{reply}"
            );
            assert!(
                serve.output().contains("purging slot"),
                "{}",
                serve.output()
            );
            // Every conversation goes on, one of them from the folder.
            let from_folder = turns
                .iter()
                .filter(|(turn, reply)| {
                    let again = chat_of(&serve, &next_turn(turn, reply, "And item 9?"));
                    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0);
                    assert!(cached >= UBATCH, "{again}\n{}", serve.output());
                    again["timings"]["cache"]["source"] == "disk"
                })
                .count();
            assert!(from_folder >= 1, "{}", serve.output());
        }
        // A state refused for want of room is no bad state.
        assert_eq!(count(&serve.output(), "discarded"), 0, "{}", serve.output());
        stop(serve);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A streamed chat too long for the context, prepared like any long prompt: llama-server's
/// refusal is one JSON object, not an event stream, and reaches the client whole.
#[test]
fn a_streamed_chat_too_long_for_the_context_gets_llama_servers_400() {
    let _turn = one_at_a_time();
    let dir = temp_dir("pc-too-long");
    let serve = serve_with(&dir, &[]);
    let long: String = (0..6).map(|i| system(&format!("topic {i}"))).collect();
    let body = json!({
        "messages": [{"role": "system", "content": long}, {"role": "user", "content": "Hi."}],
        "stream": true, "max_tokens": 8,
    });
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &body.to_string());
    assert_eq!(status, 400, "{reply}\n{}", serve.output());
    let reply: Value = serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{e}: {reply:?}"));
    assert_eq!(
        reply["error"]["type"], "exceed_context_size_error",
        "{reply}"
    );
    stop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The state `saved` left, under a second serve with `extra` (or another model): the line that
/// discards it (`says`: "discarded"), or that does not use it ("not using"), and the request
/// answering as a cold one does.
fn discarded_under(
    dir: &Path,
    model: Option<&Path>,
    extra: &[&str],
    topic: &str,
    cold: &Value,
    (says, why): (&str, &str),
) {
    let mut args = vec![
        "--prompt-cache-dir",
        dir.to_str().unwrap(),
        "--prompt-cache-min-tokens",
        MIN_TOKENS,
    ];
    args.extend_from_slice(extra);
    let serve = match model {
        Some(model) => serve_cpu(model, &args),
        None => serve_smollm2(&args),
    };
    let reply = chat(&serve, topic);
    if model.is_none() {
        assert_eq!(text(&reply), text(cold), "answers as a cold prefill");
    }
    assert!(
        reply["timings"].get("cache").is_none(),
        "not restored: {reply}"
    );
    let output = stop(serve);
    let says = format!("prompt cache: {says}");
    assert_eq!(count(&output, &says), 1, "{output}");
    let line = output.lines().find(|l| l.contains(&says)).unwrap();
    assert!(line.starts_with("1bit serve: "), "{line}");
    assert!(line.contains(why), "{line}");
    assert_eq!(count(&output, "prompt cache: restored"), 0, "{output}");
}

/// A state of another ctx or model file is another identity's: never used, said once, and
/// left in the folder for the serves it is theirs (several may share it).
#[test]
fn a_state_of_another_ctx_or_model_is_never_used_said_once_and_left() {
    let _turn = one_at_a_time();
    let (dir, cold) = saved("pc-foreign", "trains", &[]);
    let first = states(&dir);
    let bytes = std::fs::read(&first[0]).unwrap();
    discarded_under(
        &dir,
        None,
        &["--ctx-size", "4096"],
        "trains",
        &cold,
        ("not using", "other context settings"),
    );
    // The ctx 4096 serve saved its own state beside the other, untouched.
    assert_eq!(states(&dir).len(), 2);
    assert_eq!(std::fs::read(&first[0]).unwrap(), bytes);
    // A model of another file uses neither: one line for the reason both share, each
    // counted.
    let gemma = installed_model("gemma-3-270m-Q4_K_M.gguf");
    let serve = serve_cpu(
        &gemma,
        &[
            "--ctx-size",
            "2048",
            "--prompt-cache-dir",
            dir.to_str().unwrap(),
            "--prompt-cache-min-tokens",
            MIN_TOKENS,
        ],
    );
    let reply = chat(&serve, "trains");
    assert!(reply["timings"].get("cache").is_none(), "{reply}");
    assert_eq!(
        series(
            &serve,
            "onebit_prompt_cache_discards_total",
            &[("reason", "foreign")]
        ),
        2.0
    );
    let output = stop(serve);
    let lines: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("prompt cache: not using"))
        .collect();
    assert_eq!(lines.len(), 1, "{output}");
    assert!(
        lines.iter().all(|l| l.contains("another model file")),
        "{output}"
    );
    assert_eq!(count(&output, "prompt cache: discarded"), 0, "{output}");
    // The first serve's state is still there, and its own serve restores it.
    assert!(states(&dir).contains(&first[0]));
    let serve = serve_with(&dir, &[]);
    let warm = chat(&serve, "trains");
    assert_eq!(warm["timings"]["cache"]["source"], "disk", "{warm}");
    assert_eq!(text(&warm), text(&cold));
    stop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_truncated_or_corrupt_state_is_discarded_with_its_line_and_the_request_answers() {
    let _turn = one_at_a_time();
    let (dir, cold) = saved("pc-truncated", "rivers", &[]);
    let state = states(&dir).remove(0);
    let data = std::fs::read(&state).unwrap();
    std::fs::write(&state, &data[..data.len() / 2]).unwrap();
    discarded_under(
        &dir,
        None,
        &["--ctx-size", "2048"],
        "rivers",
        &cold,
        ("discarded", "not the"),
    );
    let _ = std::fs::remove_dir_all(&dir);

    // The same size, one byte of the KV changed: llama-server would restore it; the CRC-32
    // does not let it.
    let (dir, cold) = saved("pc-corrupt", "rivers", &[]);
    let state = states(&dir).remove(0);
    let mut data = std::fs::read(&state).unwrap();
    let at = data.len() - 100;
    data[at] ^= 0x40;
    std::fs::write(&state, &data).unwrap();
    discarded_under(
        &dir,
        None,
        &["--ctx-size", "2048"],
        "rivers",
        &cold,
        ("discarded", "CRC-32"),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_budget_evicts_the_least_recently_used() {
    let _turn = one_at_a_time();
    let dir = temp_dir("pc-budget");
    // A state of these prompts (550-580 tokens, 23 KB each) is 13-14 MB: 0.035 GiB (37.6 MB)
    // holds two of them, not three.
    let budget = ["--prompt-cache-gib", "0.035"];
    let serve = serve_with(&dir, &budget);
    chat(&serve, "apples");
    chat(&serve, "bridges");
    assert!(wait_until(Duration::from_secs(30), || states(&dir).len() == 2));
    // Apples is used again (its slot holds it), so bridges is the least recently used.
    std::thread::sleep(Duration::from_millis(50));
    chat(&serve, "apples");
    chat(&serve, "castles");
    assert!(wait_until(Duration::from_secs(30), || {
        series(&serve, "onebit_prompt_cache_saves_total", &[]) == 3.0
    }));
    assert_eq!(
        series(&serve, "onebit_prompt_cache_evictions_total", &[]),
        1.0
    );
    let total: u64 = states(&dir)
        .iter()
        .map(|s| std::fs::metadata(s).unwrap().len())
        .sum();
    assert!(
        total as f64 <= 0.035 * (1u64 << 30) as f64,
        "{total} bytes kept"
    );
    assert_eq!(states(&dir).len(), 2);
    stop(serve);

    // Asked in this order, since every request is a use: bridges, cold, is saved last and
    // evicts apples, the least recently used by then.
    let serve = serve_with(&dir, &budget);
    for (topic, kept) in [("apples", true), ("castles", true), ("bridges", false)] {
        let reply = chat(&serve, topic);
        assert_eq!(
            reply["timings"].get("cache").is_some(),
            kept,
            "{topic}: {reply}"
        );
    }
    stop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory serve cannot write: a read-only tmpfs (as root, whom modes do not stop), else
/// mode 0555. With `size`, a writable tmpfs that small (root only: None otherwise).
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tmpfs(name: &str, options: &str) -> Option<Mounted> {
    let dir = temp_dir(name);
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", options, "tmpfs", dir.to_str().unwrap()])
        .status()
        .is_ok_and(|s| s.success());
    mounted.then_some(Mounted(dir))
}

fn serving_goes_on(dir: &Path) {
    let serve = serve_with(dir, &[]);
    let first = chat(&serve, "deserts");
    let second = chat(&serve, "forests");
    assert!(!text(&first).is_empty() && !text(&second).is_empty());
    assert!(
        wait_until(Duration::from_secs(20), || serve
            .output()
            .contains("prompt cache: saving stopped")),
        "{}",
        serve.output()
    );
    assert_eq!(get(&serve.url("/health")).0, 200);
    let output = stop(serve);
    assert_eq!(
        count(&output, "prompt cache: saving stopped"),
        1,
        "{output}"
    );
    assert!(states(dir).is_empty());
}

#[test]
fn a_read_only_or_full_cache_directory_leaves_serving_unaffected() {
    let _turn = one_at_a_time();
    match tmpfs("pc-ro", "ro,size=1m") {
        Some(ro) => serving_goes_on(&ro.0),
        None => {
            use std::os::unix::fs::PermissionsExt;
            let dir = temp_dir("pc-ro");
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
            serving_goes_on(&dir);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    match tmpfs("pc-full", "size=256k") {
        Some(full) => serving_goes_on(&full.0),
        None => eprintln!("not root: no tmpfs to fill, the full-disk case is not run"),
    }
}

#[test]
fn precise_and_no_prompt_cache_never_restore() {
    let _turn = one_at_a_time();
    // The default directory, under serve's state directory.
    let state = temp_dir("pc-default-state");
    let env = [("ONEBIT_STATE_DIR", state.to_str().unwrap())];
    let start = |extra: &[&str]| {
        let server = installed_llama_server();
        let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
        let mut args = vec![
            "-m",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--llama-server",
            server.to_str().unwrap(),
            "--ctx-size",
            "2048",
            "--prompt-cache-min-tokens",
            MIN_TOKENS,
        ];
        args.extend_from_slice(extra);
        let serve = Serve::start(&args, &env);
        assert!(
            serve.wait_health(200, Duration::from_secs(120)),
            "{}",
            serve.output()
        );
        serve
    };
    let serve = start(&[]);
    let cold = chat(&serve, "oceans");
    stop(serve);
    let dir = state.join("prompt-cache");
    let folders: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(folders.len(), 1, "one folder per model file");
    assert!(
        folders[0]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("SmolLM2-135M-Instruct-Q4_1-")
    );
    let saved = states(&folders[0]);
    assert_eq!(saved.len(), 1);
    let bytes = std::fs::read(&saved[0]).unwrap();

    for flag in ["--precise", "--no-prompt-cache"] {
        let serve = start(&[flag]);
        assert!(
            !serve.output().contains("--slot-save-path"),
            "{flag}: {}",
            serve.output()
        );
        let reply = chat(&serve, "oceans");
        assert_eq!(text(&reply), text(&cold));
        assert!(reply["timings"].get("cache").is_none(), "{flag}: {reply}");
        assert!(
            reply["timings"]["prompt_n"].as_u64().unwrap() >= 256,
            "{flag}: prefilled whole: {reply}"
        );
        let (status, _) = get(&serve.url("/metrics"));
        assert_eq!(status, 200);
        let output = stop(serve);
        assert_eq!(count(&output, "prompt cache"), 0, "{flag}: {output}");
        assert_eq!(states(&folders[0]), saved, "{flag}: nothing saved");
        assert_eq!(std::fs::read(&saved[0]).unwrap(), bytes);
    }
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn bad_prompt_cache_flags_exit_2_with_one_line_saying_what_to_do() {
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let file = temp_dir("pc-flags").join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let file = file.to_str().unwrap();
    let cases: [(&[&str], i32, &str); 8] = [
        (
            &["--prompt-cache-gib", "0"],
            2,
            "--prompt-cache-gib 0: not a positive number of GiB; pass one such as 8",
        ),
        (
            &["--prompt-cache-gib=-1"],
            2,
            "--prompt-cache-gib -1: not a positive number",
        ),
        (
            &["--prompt-cache-gib", "NaN"],
            2,
            "--prompt-cache-gib NaN: not a positive number",
        ),
        (
            &["--prompt-cache-min-tokens", "0"],
            2,
            "--prompt-cache-min-tokens 0: a state needs at least one token; pass one such as 1024",
        ),
        (
            &["--prompt-cache-dir", file],
            2,
            "that is a file, not a directory; name a directory",
        ),
        (
            &["--prompt-cache-dir", "/tmp/x", "--no-prompt-cache"],
            2,
            "--prompt-cache-dir and --no-prompt-cache ask for opposite things; pass one of them",
        ),
        (
            &["--prompt-cache-dir", "/tmp/x", "--precise"],
            2,
            "--precise prefills every prompt whole and restores nothing; remove one of them",
        ),
        (
            &["--prompt-cache-dir", "/tmp/x", "--print-backend"],
            5,
            "--print-backend: --prompt-cache-dir needs 1bit serve in the request path",
        ),
    ];
    for (flags, code, says) in cases {
        let port = free_port();
        let mut command = std::process::Command::new(onebit());
        command
            .arg("serve")
            .args(["--port", &port.to_string()])
            .args(["-m", model.to_str().unwrap(), "--device", "cpu"])
            .args(flags)
            .env("ONEBIT_STATE_DIR", temp_dir("pc-flags-state"));
        // A flag that is not refused starts a real serve: it is stopped, and the case fails.
        let mut serve = Serve::spawn(command, port);
        let status = serve.wait_exit(Duration::from_secs(20));
        let stderr = serve.output();
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(code),
            "{flags:?}: {stderr}"
        );
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{flags:?}: one line: {stderr}");
        assert!(lines[0].starts_with("1bit serve: "), "{flags:?}: {stderr}");
        assert!(lines[0].contains(says), "{flags:?}: {stderr}");
    }
}

/// The temporary name serve `pid` gives its save number `seq`: `tmp-<pid space>-<pid>-<seq>.state`,
/// the pid space being 8 hex of this boot's id and serve's pid namespace's inode, hex.
fn temp_name(pid: u32, seq: u64) -> String {
    let boot: String = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect();
    let link = std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap();
    let link = link.to_string_lossy();
    let namespace: u64 = link
        .strip_prefix("pid:[")
        .and_then(|l| l.strip_suffix(']'))
        .unwrap()
        .parse()
        .unwrap();
    format!("tmp-{boot}{namespace:x}-{pid}-{seq}.state")
}

/// A save that cannot finish is given up at the stop's bound, and the file llama-server was
/// writing it to is removed once the backend has stopped: nothing is left in the folder.
#[test]
fn a_save_that_cannot_finish_does_not_hold_the_stop_past_its_bound() {
    let _turn = one_at_a_time();
    let dir = temp_dir("pc-stuck-save");
    // A backend stuck in its save gets a short grace, so what is timed is serve's wait.
    let mut serve = serve_with_env(
        &dir,
        &["--drain-s", "1"],
        &[("ONEBIT_BACKEND_STOP_GRACE_S", "1")],
    );
    // llama-server saves the slot under serve's first temporary name; a FIFO there that
    // nobody reads blocks its write for good, as a save of a very long state would run on.
    let fifo = dir.join(temp_name(serve.pid(), 0));
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", fifo.display());
    chat(&serve, "lighthouses");
    // The save is asked for as the reply ends; give the request a moment to reach llama-server
    // (had it not, no save would be under way and the line below would be missing).
    std::thread::sleep(Duration::from_secs(1));
    let asked = std::time::Instant::now();
    serve.signal(Signal::SIGTERM);
    let exited = serve.wait_exit(Duration::from_secs(20));
    let took = asked.elapsed();
    assert!(exited.is_some(), "serve did not stop:\n{}", serve.output());
    // The window (1 s), half a second for the saves, the backend's grace (1 s) and its kill.
    assert!(
        took < Duration::from_secs(4),
        "took {took:?} from SIGTERM to exit:\n{}",
        serve.output()
    );
    assert_eq!(
        count(
            &serve.output(),
            "1bit serve: prompt cache: 1 save(s) still under way when the stop's time ran out; not kept (a longer --drain-s gives them time)"
        ),
        1,
        "{}",
        serve.output()
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(
        left.is_empty(),
        "nothing kept, no temporary file left: {left:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
