//! One prompt cache for the fleet (issue 44, item 4), with the real, pinned llama-server and
//! SmolLM2 on the cpu route: two serves on loopback given one `--prompt-cache-dir` (no gateway
//! in front; the gateway's own test sends the turns through it). A conversation's first turn
//! served and saved by one, its second turn sent to the other: the other restores the first's
//! prefix (`cached_tokens` covering it) and answers as a cold serve does, token for token. Two
//! serves saving the same conversation at once leave a state a third restores exactly. A folder
//! that cannot be read (replaced by a file) leaves serving on, said once, until it is back.
//! The store's own concurrency (several serves saving, restoring and evicting in one folder):
//! host/features/src/prompt_cache/store_tests.rs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use onebit_tests::prompt_cache_chats::*;
use onebit_tests::*;

fn model() -> PathBuf {
    installed_model("SmolLM2-135M-Instruct-Q4_1.gguf")
}

/// A serve of SmolLM2 whose prompt cache is `dir`.
fn serve_with(dir: &Path) -> Serve {
    serve_cpu(
        &model(),
        &[
            "--ctx-size",
            "2048",
            "--prompt-cache-dir",
            dir.to_str().unwrap(),
            "--prompt-cache-min-tokens",
            MIN_TOKENS,
        ],
    )
}

/// A serve that keeps no cache: every prompt prefilled cold.
fn cold_serve() -> Serve {
    serve_cpu(&model(), &["--ctx-size", "2048", "--no-prompt-cache"])
}

/// The files of a kind (`json`, `state`) in the folder, temporary ones aside.
fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| {
        p.extension().is_some_and(|e| e == ext)
            && !p.file_name().unwrap().to_string_lossy().starts_with("tmp-")
    });
    v.sort();
    v
}

#[test]
fn a_conversation_saved_by_one_serve_is_restored_by_another_and_answers_as_a_cold_one() {
    let _turn = one_at_a_time();
    let dir = temp_dir("pc-fleet");
    let a = serve_with(&dir);
    let b = serve_with(&dir);
    for serve in [&a, &b] {
        assert_eq!(
            count(&serve.output(), "(states: 0, "),
            1,
            "{}",
            serve.output()
        );
    }

    // Turn one on A, saved when its reply ends.
    let first = first_turn("ships");
    let reply1 = chat_of(&a, &first);
    let p1 = reply1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(p1 >= 256, "{reply1}");
    assert!(
        wait_until(Duration::from_secs(30), || files(&dir, "json").len() == 1),
        "A saved turn one:\n{}",
        a.output()
    );
    // Turn two on B: the state A saved is restored, up to its last whole micro-batch.
    let second = next_turn(&first, &reply1, "And item 8?");
    let warm = chat_of(&b, &second);
    let restored = p1 / UBATCH * UBATCH;
    assert_eq!(warm["timings"]["cache"]["source"], "disk", "{warm}");
    assert_eq!(
        warm["timings"]["cache"]["n"].as_u64(),
        Some(restored),
        "{warm}"
    );
    assert_eq!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(restored),
        "{warm}"
    );
    assert_eq!(
        warm["timings"]["cache_n"].as_u64(),
        Some(restored),
        "{warm}"
    );
    let said = format!("prompt cache: restored {restored} of the prompt's tokens");
    assert_eq!(count(&b.output(), &said), 1, "{}", b.output());
    for line in b.output().lines().filter(|l| l.contains(&said)) {
        println!("B: {line}");
    }

    // Another conversation's first turn on both at once: two saves of one prefix, harmless.
    let rivers = first_turn("rivers");
    let (ra, rb) = std::thread::scope(|s| {
        let ra = s.spawn(|| chat_of(&a, &rivers));
        let rb = s.spawn(|| chat_of(&b, &rivers));
        (ra.join().unwrap(), rb.join().unwrap())
    });
    assert_eq!(text(&ra), text(&rb));
    // The stops wait for the saves under way.
    let (out_a, out_b) = (stop(a), stop(b));
    for output in [&out_a, &out_b] {
        assert_eq!(count(output, "prompt cache: discarded"), 0, "{output}");
        assert_eq!(count(output, "saving stopped"), 0, "{output}");
    }
    let states = files(&dir, "state");
    let descriptions = files(&dir, "json");
    assert_eq!(
        states.len(),
        descriptions.len(),
        "{states:?} {descriptions:?}"
    );

    // A third serve restores the rivers state, and answers as the cold serve does.
    let c = serve_with(&dir);
    let rivers_warm = chat_of(&c, &rivers);
    assert_eq!(
        rivers_warm["timings"]["cache"]["source"], "disk",
        "{rivers_warm}"
    );
    let out_c = stop(c);
    assert_eq!(count(&out_c, "prompt cache: discarded"), 0, "{out_c}");
    let cold = cold_serve();
    let cold_second = chat_of(&cold, &second);
    let cold_rivers = chat_of(&cold, &rivers);
    stop(cold);
    assert_eq!(
        text(&warm),
        text(&cold_second),
        "turn two on B, token for token"
    );
    assert_eq!(text(&rivers_warm), text(&cold_rivers));
    assert_eq!(text(&ra), text(&cold_rivers));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_folder_that_cannot_be_read_leaves_serving_on_said_once_until_it_is_back() {
    let _turn = one_at_a_time();
    let dir = temp_dir("pc-lost");
    let serve = serve_with(&dir);
    chat_of(&serve, &first_turn("deserts"));
    assert!(wait_until(Duration::from_secs(30), || files(&dir, "json")
        .len()
        == 1));
    // The folder replaced by a file (the tests run as root, whom a mode 000 does not stop).
    let aside = dir.with_extension("aside");
    std::fs::rename(&dir, &aside).unwrap();
    std::fs::write(&dir, b"not a folder").unwrap();
    for topic in ["forests", "deserts", "glaciers"] {
        let reply = chat_of(&serve, &first_turn(topic));
        assert!(!text(&reply).is_empty());
        assert!(reply["timings"].get("cache").is_none(), "{reply}");
    }
    assert_eq!(get(&serve.url("/health")).0, 200);
    let gone = format!("prompt cache: {} cannot be read", dir.display());
    assert_eq!(count(&serve.output(), &gone), 1, "{}", serve.output());
    // Back: said, and the next long prompt is saved again.
    std::fs::remove_file(&dir).unwrap();
    std::fs::rename(&aside, &dir).unwrap();
    chat_of(&serve, &first_turn("canyons"));
    assert!(
        wait_until(Duration::from_secs(30), || files(&dir, "json").len() == 2),
        "{}",
        serve.output()
    );
    let output = stop(serve);
    assert_eq!(count(&output, &gone), 1, "{output}");
    assert_eq!(count(&output, "can be read again"), 1, "{output}");
    for never in ["saving stopped", "prompt cache: discarded"] {
        assert_eq!(count(&output, never), 0, "{never}: {output}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
