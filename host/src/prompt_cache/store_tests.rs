use super::*;

fn identity(ctx: u64) -> Identity {
    Identity {
        model_path: "/m/a.gguf".into(),
        model_bytes: 10,
        model_header_sha256: "aa".into(),
        llama_build: "b1".into(),
        llama_sha256: "bb".into(),
        n_ctx_slot: ctx,
        total_slots: 4,
        kv_settings: vec![],
    }
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("onebit-pc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A state file as llama-server saves one: packed tokens, then `pad` bytes of "KV".
fn saved(dir: &Path, seq: u64, tokens: &[i32], pad: usize) -> String {
    let mut data = Vec::new();
    let mut word = |w: u32| data.extend_from_slice(&w.to_le_bytes());
    word(SEQ_MAGIC);
    word(SEQ_VERSION);
    word(tokens.len() as u32 + 4);
    word(u32::MAX);
    word(1);
    word(tokens.len() as u32);
    for t in tokens {
        word(*t as u32);
    }
    word(0);
    data.extend(std::iter::repeat_n(7u8, pad));
    let name = Store::temp_name(seq);
    std::fs::write(dir.join(&name), data).unwrap();
    name
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_saved_state_is_kept_0600_found_by_prefix_and_verified() {
    let d = dir("keep");
    let (mut store, gone) = Store::open(&d, 1 << 20, identity(2048));
    assert!(gone.is_empty());
    let temp = saved(&d, 1, &[1, 2, 3, 4], 100);
    assert!(matches!(
        store.admit(&temp, 2, usize::MAX).unwrap(),
        Admitted::Kept { evicted: 0, .. }
    ));
    let names = files(&d);
    assert_eq!(names.len(), 2, "{names:?}");
    for n in &names {
        let mode = std::fs::metadata(d.join(n)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{n}");
    }
    let (entry, n) = store.best(&[1, 2, 3, 9]).unwrap();
    assert_eq!(n, 3);
    store.verify(&entry).unwrap();
    // A second serve finds it again.
    let (store, gone) = Store::open(&d, 1 << 20, identity(2048));
    assert!(gone.is_empty());
    assert_eq!(store.best(&[1, 2]).unwrap().1, 2);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn short_held_and_oversized_states_are_not_kept() {
    let d = dir("drop");
    let (mut store, _) = Store::open(&d, 1000, identity(2048));
    let t = saved(&d, 1, &[1, 2], 10);
    assert_eq!(
        store.admit(&t, 3, usize::MAX).unwrap(),
        Admitted::Dropped("shorter than --prompt-cache-min-tokens")
    );
    let t = saved(&d, 2, &[1, 2, 3], 10);
    assert!(matches!(
        store.admit(&t, 3, usize::MAX).unwrap(),
        Admitted::Kept { .. }
    ));
    let t = saved(&d, 3, &[1, 2, 3], 10);
    assert_eq!(
        store.admit(&t, 3, usize::MAX).unwrap(),
        Admitted::Dropped("already held")
    );
    let t = saved(&d, 4, &[5, 6, 7], 2000);
    assert_eq!(
        store.admit(&t, 3, usize::MAX).unwrap(),
        Admitted::Dropped("larger than the whole budget")
    );
    assert_eq!(files(&d).len(), 2, "no temporary file is left");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_budget_evicts_the_least_recently_used_and_a_longer_state_replaces_its_prefix() {
    let d = dir("lru");
    let (mut store, _) = Store::open(&d, 750, identity(2048));
    for (seq, first) in [(1, 10), (2, 20), (3, 30)] {
        let t = saved(&d, seq, &[first, 1, 2], 200);
        store.admit(&t, 1, usize::MAX).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    // Used: 10 is now the most recent; a fourth evicts 20, the least recently used.
    let (ten, _) = store.best(&[10, 1, 2]).unwrap();
    store.touch(&ten);
    let t = saved(&d, 4, &[40, 1, 2], 200);
    assert!(matches!(
        store.admit(&t, 1, usize::MAX).unwrap(),
        Admitted::Kept { evicted: 1, .. }
    ));
    assert!(store.total_bytes() <= 750);
    assert!(store.best(&[20, 1, 2]).is_none_or(|(_, n)| n == 0));
    assert_eq!(store.best(&[10, 1, 2]).unwrap().1, 3);
    // Across a restart the order holds (the description's mtime).
    let (store, _) = Store::open(&d, 500, identity(2048));
    assert_eq!(store.count(), 2);
    assert_eq!(store.best(&[10, 1, 2]).unwrap().1, 3);
    assert!(store.best(&[30, 1, 2]).is_none_or(|(_, n)| n == 0));
    // A longer state of the same conversation replaces the shorter.
    let (mut store, _) = Store::open(&d, 10_000, identity(2048));
    let t = saved(&d, 5, &[10, 1, 2, 3, 4], 200);
    assert!(matches!(
        store.admit(&t, 1, usize::MAX).unwrap(),
        Admitted::Kept { evicted: 1, .. }
    ));
    assert_eq!(store.count(), 2);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn foreign_truncated_and_corrupt_files_are_discarded_with_a_reason() {
    let d = dir("bad");
    let (mut store, _) = Store::open(&d, 1 << 20, identity(2048));
    for seq in 1..=3 {
        let t = saved(&d, seq, &[seq as i32, 1, 2], 100);
        store.admit(&t, 1, usize::MAX).unwrap();
    }
    // Another ctx: every file is foreign.
    let (other, gone) = Store::open(&d, 1 << 20, identity(4096));
    assert_eq!(other.count(), 0);
    assert_eq!(gone.len(), 3);
    assert!(gone.iter().all(|g| g.reason == Reason::Foreign), "{gone:?}");
    assert!(gone[0].why.contains("ctx per slot 2048"), "{gone:?}");
    assert!(files(&d).is_empty());

    let (mut store, _) = Store::open(&d, 1 << 20, identity(2048));
    for seq in 1..=2 {
        let t = saved(&d, seq, &[seq as i32, 1, 2], 100);
        store.admit(&t, 1, usize::MAX).unwrap();
    }
    let state = |first: i32| {
        let (e, _) = store.best(&[first, 1, 2]).unwrap();
        (e.clone(), d.join(Store::file_name(&e)))
    };
    let (one, one_path) = state(1);
    let (two, two_path) = state(2);
    // Truncated: found when the directory is read.
    let data = std::fs::read(&one_path).unwrap();
    std::fs::write(&one_path, &data[..data.len() - 10]).unwrap();
    // Corrupt, same size: found by the CRC before a restore.
    let mut data = std::fs::read(&two_path).unwrap();
    *data.last_mut().unwrap() ^= 1;
    std::fs::write(&two_path, &data).unwrap();
    let (mut store, gone) = Store::open(&d, 1 << 20, identity(2048));
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].reason, Reason::Truncated);
    assert!(gone[0].file.ends_with(Store::file_name(&one)));
    let bad = store.verify(&two).unwrap_err();
    assert_eq!(bad.reason, Reason::Corrupt);
    assert_eq!(store.count(), 0);
    assert!(files(&d).is_empty());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn leftovers_of_a_dead_serve_go_and_a_fresh_state_without_description_stays() {
    let d = dir("left");
    std::fs::write(d.join("tmp-999999999-3.state"), b"x").unwrap();
    std::fs::write(d.join(format!("tmp-{}-4.state", std::process::id())), b"x").unwrap();
    std::fs::write(d.join("abc.state"), b"x").unwrap();
    let (_, gone) = Store::open(&d, 1 << 20, identity(2048));
    assert!(gone.is_empty());
    assert_eq!(files(&d).len(), 2, "{:?}", files(&d));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_token_list_is_read_packed_or_plain() {
    let mut plain = Vec::new();
    for w in [SEQ_MAGIC, SEQ_VERSION, 2, 5, 6] {
        plain.extend_from_slice(&w.to_le_bytes());
    }
    assert_eq!(state_tokens(&plain), Some(vec![5, 6]));
    assert_eq!(state_tokens(&plain[..12]), None);
    assert_eq!(state_tokens(b"GGUFxxxxxxxxxxxx"), None);
}

#[test]
fn a_state_is_chosen_and_kept_by_its_exact_part() {
    let d = dir("exact");
    let (mut store, _) = Store::open(&d, 1 << 20, identity(2048));
    // Too few exact tokens to be restored at all: not kept.
    let t = saved(&d, 1, &[1, 2, 3, 4, 5, 6], 10);
    assert_eq!(
        store.admit(&t, 3, 2).unwrap(),
        Admitted::Dropped("fewer exact tokens than --prompt-cache-min-tokens")
    );
    // Exact through 4 of its 6 tokens.
    let t = saved(&d, 2, &[1, 2, 3, 4, 5, 6], 10);
    assert!(matches!(
        store.admit(&t, 3, 4).unwrap(),
        Admitted::Kept { .. }
    ));
    // A longer state of the same conversation, but exact through only 3: it does not replace
    // the more exact one, and a prompt both share is given the more exact.
    let t = saved(&d, 3, &[1, 2, 3, 4, 5, 6, 7, 8], 10);
    assert!(matches!(
        store.admit(&t, 3, 3).unwrap(),
        Admitted::Kept { evicted: 0, .. }
    ));
    assert_eq!(store.count(), 2);
    let (entry, shared) = store.best(&[1, 2, 3, 4, 5, 6, 7, 9]).unwrap();
    assert_eq!((entry.tokens.len(), entry.exact, shared), (6, 4, 6));
    // The same tokens again, no more exact: already held; more exact: it replaces the entry.
    let t = saved(&d, 4, &[1, 2, 3, 4, 5, 6], 10);
    assert_eq!(
        store.admit(&t, 3, 4).unwrap(),
        Admitted::Dropped("already held")
    );
    assert!(store.holds(&[1, 2, 3, 4, 5, 6], 4));
    assert!(!store.holds(&[1, 2, 3, 4, 5, 6], 6));
    // Its exact part is read back by the next serve.
    let (store, gone) = Store::open(&d, 1 << 20, identity(2048));
    assert!(gone.is_empty());
    let (entry, _) = store.best(&[1, 2, 3, 4, 5, 6]).unwrap();
    assert_eq!(entry.exact, 4);
    std::fs::remove_dir_all(&d).unwrap();
}
