use super::super::{copy, folder};
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

/// The key of `identity(4096)`.
fn other_key() -> String {
    identity(4096).key()
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("onebit-pc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A state file as llama-server saves one: packed tokens, then the "KV".
fn state_data(tokens: &[i32], kv: &[u8]) -> Vec<u8> {
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
    data.extend_from_slice(kv);
    data
}

/// A state saved under the temporary name `seq`, with `pad` bytes of "KV".
fn saved(dir: &Path, seq: u64, tokens: &[i32], pad: usize) -> String {
    let name = Store::temp_name(seq);
    std::fs::write(dir.join(&name), state_data(tokens, &vec![7u8; pad])).unwrap();
    name
}

/// An entry's state as a restore reads it (its private copy, unmarked), or why not.
fn read_back(dir: &Path, entry: &Entry) -> Result<Vec<u8>, Unusable> {
    let temp = Store::restore_temp_name(u64::MAX);
    let copied = copy::private(dir, entry, entry.tokens.len(), &temp);
    let data = std::fs::read(dir.join(&temp));
    let _ = std::fs::remove_file(dir.join(&temp));
    assert_eq!(copied?, Source::Copy { marked: false });
    Ok(data.unwrap())
}

fn open(dir: &Path, budget: u64, identity: Identity) -> (Store, News) {
    let mut store = Store::open(dir, budget, identity);
    let news = store.take_news();
    (store, news)
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
    let (mut store, news) = open(&d, 1 << 20, identity(2048));
    assert!(news.discarded.is_empty() && news.others.is_empty());
    let temp = saved(&d, 1, &[1, 2, 3, 4], 100);
    assert!(matches!(
        store.admit(&temp, 2, &[1, 2, 3, 4], usize::MAX).unwrap(),
        Admitted::Kept { evicted: 0, .. }
    ));
    let names = files(&d);
    assert_eq!(names.len(), 2, "{names:?}");
    for n in &names {
        let mode = std::fs::metadata(d.join(n)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{n}");
    }
    assert!(names.iter().all(|n| n.starts_with(&identity(2048).key())));
    let (entry, n) = store.best(&[1, 2, 3, 9]).unwrap();
    assert_eq!(n, 3);
    read_back(&d, &entry).unwrap();
    // A second serve finds it again.
    let (store, news) = open(&d, 1 << 20, identity(2048));
    assert!(news.discarded.is_empty());
    assert_eq!(store.best(&[1, 2]).unwrap().1, 2);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn short_held_and_oversized_states_are_not_kept() {
    let d = dir("drop");
    let (mut store, _) = open(&d, 1000, identity(2048));
    let t = saved(&d, 1, &[1, 2], 10);
    assert_eq!(
        store.admit(&t, 3, &[1, 2], usize::MAX).unwrap(),
        Admitted::Dropped("shorter than --prompt-cache-min-tokens")
    );
    let t = saved(&d, 2, &[1, 2, 3], 10);
    assert!(matches!(
        store.admit(&t, 3, &[1, 2, 3], usize::MAX).unwrap(),
        Admitted::Kept { .. }
    ));
    let t = saved(&d, 3, &[1, 2, 3], 10);
    assert_eq!(
        store.admit(&t, 3, &[1, 2, 3], usize::MAX).unwrap(),
        Admitted::Dropped("already held")
    );
    let t = saved(&d, 4, &[5, 6, 7], 2000);
    assert_eq!(
        store.admit(&t, 3, &[5, 6, 7], usize::MAX).unwrap(),
        Admitted::Dropped("larger than the whole budget")
    );
    assert_eq!(files(&d).len(), 2, "no temporary file is left");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_budget_evicts_the_least_recently_used_and_a_longer_state_replaces_its_prefix() {
    let d = dir("lru");
    let (mut store, _) = open(&d, 750, identity(2048));
    for (seq, first) in [(1, 10), (2, 20), (3, 30)] {
        let t = saved(&d, seq, &[first, 1, 2], 200);
        store.admit(&t, 1, &[first, 1, 2], usize::MAX).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    // Used: 10 is now the most recent; a fourth evicts 20, the least recently used.
    let (ten, _) = store.best(&[10, 1, 2]).unwrap();
    store.touch(&ten);
    let t = saved(&d, 4, &[40, 1, 2], 200);
    assert!(matches!(
        store.admit(&t, 1, &[40, 1, 2], usize::MAX).unwrap(),
        Admitted::Kept { evicted: 1, .. }
    ));
    assert!(store.total_bytes() <= 750);
    assert!(store.best(&[20, 1, 2]).is_none_or(|(_, n)| n == 0));
    assert_eq!(store.best(&[10, 1, 2]).unwrap().1, 3);
    // Across a restart the order holds (the description's mtime).
    let (store, _) = open(&d, 500, identity(2048));
    assert_eq!(store.count(), 2);
    assert_eq!(store.best(&[10, 1, 2]).unwrap().1, 3);
    assert!(store.best(&[30, 1, 2]).is_none_or(|(_, n)| n == 0));
    // A longer state of the same conversation replaces the shorter.
    let (mut store, _) = open(&d, 10_000, identity(2048));
    let t = saved(&d, 5, &[10, 1, 2, 3, 4], 200);
    assert!(matches!(
        store.admit(&t, 1, &[10, 1, 2, 3, 4], usize::MAX).unwrap(),
        Admitted::Kept { evicted: 1, .. }
    ));
    assert_eq!(store.count(), 2);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn foreign_states_are_never_used_nor_removed_and_bad_ones_are_discarded_with_a_reason() {
    let d = dir("bad");
    let (mut store, _) = open(&d, 1 << 20, identity(2048));
    for seq in 1..=3 {
        let t = saved(&d, seq, &[seq as i32, 1, 2], 100);
        store.admit(&t, 1, &[seq as i32, 1, 2], usize::MAX).unwrap();
    }
    // Another ctx: every state is another identity's, not used, left in place; its reason
    // said once.
    let (mut other, news) = open(&d, 1 << 20, identity(4096));
    assert_eq!(other.count(), 0);
    assert!(other.best(&[1, 1, 2]).is_none());
    assert!(news.discarded.is_empty(), "{news:?}");
    assert_eq!(news.others.len(), 3, "{news:?}");
    assert_eq!(news.others.iter().filter(|o| o.first).count(), 1);
    assert!(news.others[0].why.contains("ctx per slot 2048"), "{news:?}");
    assert_eq!(files(&d).len(), 6);
    // Its own state beside them; neither sees the other's, and a look again says nothing new.
    let t = saved(&d, 9, &[1, 1, 2], 100);
    other.admit(&t, 1, &[1, 1, 2], usize::MAX).unwrap();
    assert_eq!(other.count(), 1);
    store.refresh().unwrap();
    assert_eq!(store.count(), 3);
    let news = store.take_news();
    assert_eq!(news.others.len(), 1);
    assert!(news.others[0].why.contains("ctx per slot 4096"), "{news:?}");
    assert_eq!(store.best(&[1, 1, 2]).unwrap().0.tokens, [1, 1, 2]);
    assert_ne!(
        store.best(&[1, 1, 2]).unwrap().0.name,
        other.best(&[1, 1, 2]).unwrap().0.name
    );
    // A description copied under another identity's name is not taken either.
    let (mine, _) = store.best(&[2, 1, 2]).unwrap();
    let renamed = format!("{}-{}", other_key(), mine.name.split_once('-').unwrap().1);
    for ext in ["json", "state"] {
        std::fs::copy(
            d.join(format!("{}.{ext}", mine.name)),
            d.join(format!("{renamed}.{ext}")),
        )
        .unwrap();
    }
    let (fresh, news) = open(&d, 1 << 20, identity(2048));
    assert_eq!(fresh.count(), 3);
    assert!(
        news.others
            .iter()
            .any(|o| o.why.contains("its name says identity")),
        "{news:?}"
    );
    std::fs::remove_dir_all(&d).unwrap();

    let d = dir("bad2");
    let (mut store, _) = open(&d, 1 << 20, identity(2048));
    for seq in 1..=2 {
        let t = saved(&d, seq, &[seq as i32, 1, 2], 100);
        store.admit(&t, 1, &[seq as i32, 1, 2], usize::MAX).unwrap();
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
    let (mut store, news) = open(&d, 1 << 20, identity(2048));
    let gone = news.discarded;
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].reason, Reason::Truncated);
    assert!(gone[0].file.ends_with(Store::file_name(&one)));
    let Err(Unusable::Bad(reason, why)) = read_back(&d, &two) else {
        panic!("a corrupt state read back")
    };
    assert_eq!(reason, Reason::Corrupt);
    store.discard(&two, reason, why);
    assert_eq!(store.count(), 0);
    assert!(files(&d).is_empty());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn leftovers_of_dead_or_silent_writers_go_and_a_fresh_state_without_description_stays() {
    let d = dir("left");
    let me = std::process::id();
    let space = folder::pid_space(me);
    let old = SystemTime::now() - Duration::from_secs(3600);
    let aged = |name: &str| {
        let file = std::fs::File::options()
            .append(true)
            .open(d.join(name))
            .unwrap();
        file.set_modified(old).unwrap();
    };
    // Gone: an older serve's of a dead pid; this pid space's of a dead pid; anyone's not
    // written for an hour (another box's, whose pid this one cannot see).
    std::fs::write(d.join("tmp-999999999-3.state"), b"x").unwrap();
    std::fs::write(d.join(format!("tmp-{space}-999999999-3.state")), b"x").unwrap();
    std::fs::write(d.join("tmp-0abc-12-r4.state"), b"x").unwrap();
    aged("tmp-0abc-12-r4.state");
    // Kept: this serve's (alive), in either form; another box's written now; a state
    // without description younger than two minutes (another serve's save under way).
    let kept = [
        format!("tmp-{me}-4.state"),
        Store::temp_name(5),
        Store::restore_temp_name(6),
        "tmp-0abc-12-7.state".to_string(),
        "abc.state".to_string(),
    ];
    for name in &kept {
        std::fs::write(d.join(name), b"x").unwrap();
    }
    assert!(Store::temp_name(5).starts_with(&format!("tmp-{space}-{me}-")));
    let (_, news) = open(&d, 1 << 20, identity(2048));
    assert!(news.discarded.is_empty());
    let mut kept = kept.to_vec();
    kept.sort();
    assert_eq!(files(&d), kept);
    // A state without description, old: a save cut off, discarded.
    aged("abc.state");
    let (_, news) = open(&d, 1 << 20, identity(2048));
    assert_eq!(news.discarded.len(), 1);
    assert_eq!(files(&d).len(), kept.len() - 1);
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

/// A slot another request took between a reply's end and its save holds that request's
/// tokens: only what they share with the prompt that was prefilled is vouched for.
#[test]
fn a_saved_slot_that_holds_another_prompt_is_exact_only_where_they_agree() {
    let d = dir("taken");
    let (mut store, _) = open(&d, 1 << 20, identity(2048));
    let t = saved(&d, 1, &[9, 8, 7, 6, 5, 4], 10);
    assert_eq!(
        store.admit(&t, 3, &[1, 2, 3, 4, 5, 6], 6).unwrap(),
        Admitted::Dropped("fewer exact tokens than --prompt-cache-min-tokens")
    );
    let t = saved(&d, 2, &[1, 2, 3, 7, 7, 7], 10);
    assert!(matches!(
        store.admit(&t, 3, &[1, 2, 3, 4, 5, 6], 6).unwrap(),
        Admitted::Kept { .. }
    ));
    let (entry, _) = store.best(&[1, 2, 3, 7, 7, 7]).unwrap();
    assert_eq!(entry.exact, 3);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_state_is_chosen_and_kept_by_its_exact_part() {
    let d = dir("exact");
    let (mut store, _) = open(&d, 1 << 20, identity(2048));
    // Too few exact tokens to be restored at all: not kept.
    let t = saved(&d, 1, &[1, 2, 3, 4, 5, 6], 10);
    assert_eq!(
        store.admit(&t, 3, &[1, 2, 3, 4, 5, 6], 2).unwrap(),
        Admitted::Dropped("fewer exact tokens than --prompt-cache-min-tokens")
    );
    // Exact through 4 of its 6 tokens.
    let t = saved(&d, 2, &[1, 2, 3, 4, 5, 6], 10);
    assert!(matches!(
        store.admit(&t, 3, &[1, 2, 3, 4, 5, 6], 4).unwrap(),
        Admitted::Kept { .. }
    ));
    // A longer state of the same conversation, but exact through only 3: it does not replace
    // the more exact one, and a prompt both share is given the more exact.
    let t = saved(&d, 3, &[1, 2, 3, 4, 5, 6, 7, 8], 10);
    assert!(matches!(
        store.admit(&t, 3, &[1, 2, 3, 4, 5, 6, 7, 8], 3).unwrap(),
        Admitted::Kept { evicted: 0, .. }
    ));
    assert_eq!(store.count(), 2);
    let (entry, shared) = store.best(&[1, 2, 3, 4, 5, 6, 7, 9]).unwrap();
    assert_eq!((entry.tokens.len(), entry.exact, shared), (6, 4, 6));
    // The same tokens again, no more exact: already held; more exact: it replaces the entry.
    let t = saved(&d, 4, &[1, 2, 3, 4, 5, 6], 10);
    assert_eq!(
        store.admit(&t, 3, &[1, 2, 3, 4, 5, 6], 4).unwrap(),
        Admitted::Dropped("already held")
    );
    assert!(store.holds(&[1, 2, 3, 4, 5, 6], 4));
    assert!(!store.holds(&[1, 2, 3, 4, 5, 6], 6));
    // Its exact part is read back by the next serve.
    let (store, news) = open(&d, 1 << 20, identity(2048));
    assert!(news.discarded.is_empty());
    let (entry, _) = store.best(&[1, 2, 3, 4, 5, 6]).unwrap();
    assert_eq!(entry.exact, 4);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Set a folder's mtime `ago` in the past: its stamp changes, and is not racy.
fn stamp_back(dir: &Path, ago: Duration) {
    std::fs::File::open(dir)
        .unwrap()
        .set_modified(SystemTime::now() - ago)
        .unwrap();
}

#[test]
fn another_serves_state_is_seen_at_the_next_look_and_its_eviction_too() {
    let d = dir("peer");
    let (mut a, _) = open(&d, 1 << 20, identity(2048));
    let (mut b, _) = open(&d, 1 << 20, identity(2048));
    let t = saved(&d, 1, &[1, 2, 3, 4], 100);
    a.admit(&t, 2, &[1, 2, 3, 4], usize::MAX).unwrap();
    assert!(b.best(&[1, 2, 3]).is_none(), "not yet looked");
    assert!(b.refresh().unwrap(), "the folder changed: listed");
    let (entry, n) = b.best(&[1, 2, 3, 9]).unwrap();
    assert_eq!(n, 3);
    assert_eq!(read_back(&d, &entry).unwrap().len() as u64, entry.bytes);
    // Nothing changed since (the folder's mtime left in the past): one stat, no listing.
    stamp_back(&d, Duration::from_secs(10));
    assert!(b.refresh().unwrap());
    assert!(!b.refresh().unwrap(), "an unchanged folder is not listed");
    // A longer state of the same conversation, saved by b, replaces a's; a sees it go.
    let t = saved(&d, 2, &[1, 2, 3, 4, 5], 100);
    assert!(matches!(
        b.admit(&t, 2, &[1, 2, 3, 4, 5], usize::MAX).unwrap(),
        Admitted::Kept { evicted: 1, .. }
    ));
    a.refresh().unwrap();
    assert_eq!(a.count(), 1);
    assert_eq!(a.best(&[1, 2, 3, 4, 5]).unwrap().1, 5);
    // a's state, still in its index when b removed it, is gone: forgotten, not discarded.
    assert!(matches!(read_back(&d, &entry), Err(Unusable::Gone)));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_budget_is_the_folders_whoever_made_the_states() {
    let d = dir("shared-budget");
    // Room for two states of 240 bytes, not three.
    let (mut a, _) = open(&d, 500, identity(2048));
    let (mut b, _) = open(&d, 500, identity(4096));
    let t = saved(&d, 1, &[10, 1, 2], 200);
    a.admit(&t, 1, &[10, 1, 2], usize::MAX).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let t = saved(&d, 2, &[20, 1, 2], 200);
    a.admit(&t, 1, &[20, 1, 2], usize::MAX).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    // Another identity's save evicts a's least recently used.
    let t = saved(&d, 3, &[30, 1, 2], 200);
    assert!(matches!(
        b.admit(&t, 1, &[30, 1, 2], usize::MAX).unwrap(),
        Admitted::Kept { evicted: 1, .. }
    ));
    assert_eq!(b.folder_bytes(), 480);
    a.refresh().unwrap();
    assert_eq!(a.count(), 1);
    assert!(a.best(&[20, 1, 2]).is_some_and(|(_, n)| n == 3));
    assert!(a.best(&[10, 1, 2]).is_none());
    assert_eq!(files(&d).len(), 4);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_restore_reads_a_private_copy_and_the_state_itself_is_never_written() {
    let d = dir("copy");
    let (mut store, _) = open(&d, 1 << 20, identity(2048));
    let tokens: Vec<i32> = (100..120).collect();
    let t = saved(&d, 1, &tokens, 64);
    store.admit(&t, 2, &tokens, usize::MAX).unwrap();
    let (entry, _) = store.best(&tokens).unwrap();
    let original = std::fs::read(d.join(Store::file_name(&entry))).unwrap();
    let temp = Store::restore_temp_name(1);
    assert_eq!(
        copy::private(&d, &entry, 8, &temp).unwrap(),
        Source::Copy { marked: true }
    );
    let copy = std::fs::read(d.join(&temp)).unwrap();
    let state = std::fs::read(d.join(Store::file_name(&entry))).unwrap();
    assert_eq!(state, original, "the state in the folder is untouched");
    assert_eq!(copy.len(), original.len());
    let differ: Vec<usize> = (0..copy.len())
        .filter(|i| copy[*i] != original[*i])
        .collect();
    assert!(
        !differ.is_empty()
            && differ
                .iter()
                .all(|i| (12 + 4 * 11..12 + 4 * 12).contains(i)),
        "the copy differs at token 8 only: {differ:?}"
    );
    assert_eq!(state_tokens(&copy).unwrap()[..8], tokens[..8]);
    assert_ne!(state_tokens(&copy).unwrap()[8], tokens[8]);
    std::fs::remove_file(d.join(&temp)).unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_folder_that_cannot_be_read_is_an_error_until_it_is_back() {
    let d = dir("lost");
    let (mut store, _) = open(&d, 1 << 20, identity(2048));
    let t = saved(&d, 1, &[1, 2, 3], 10);
    store.admit(&t, 1, &[1, 2, 3], usize::MAX).unwrap();
    // Replaced by a file (as root, modes stop nothing: a removed folder or a file in its
    // place is what fails for every user).
    let aside = d.with_extension("aside");
    std::fs::rename(&d, &aside).unwrap();
    std::fs::write(&d, b"not a folder").unwrap();
    assert!(store.refresh().is_err());
    let t = Store::temp_name(2);
    assert!(store.admit(&t, 1, &[], usize::MAX).is_err());
    std::fs::remove_file(&d).unwrap();
    assert!(store.refresh().is_err(), "removed");
    std::fs::rename(&aside, &d).unwrap();
    assert!(store.refresh().unwrap(), "back: listed again");
    assert_eq!(store.count(), 1);
    std::fs::remove_dir_all(&d).unwrap();
}

/// What a look at the folder costs per request, printed (not a timed assertion): the stat
/// of an unchanged folder, and a listing of one holding 200 states when another serve added
/// one.
#[test]
fn what_a_look_at_the_folder_costs() {
    let d = dir("cost");
    let (mut a, _) = open(&d, 1 << 30, identity(2048));
    for seq in 0..200 {
        let tokens: Vec<i32> = (0..2000).map(|i| i + seq as i32 * 7).collect();
        let t = saved(&d, seq, &tokens, 64);
        a.admit(&t, 1, &tokens, usize::MAX).unwrap();
    }
    let (mut b, _) = open(&d, 1 << 30, identity(2048));
    assert_eq!(b.count(), 200);
    stamp_back(&d, Duration::from_secs(10));
    assert!(b.refresh().unwrap());
    let n = 20_000;
    let began = std::time::Instant::now();
    for _ in 0..n {
        assert!(!b.refresh().unwrap());
    }
    let unchanged = began.elapsed() / n;
    // Listed again, nothing new in it (the folder's mtime changed alone).
    let mut relisting = Duration::ZERO;
    for round in 0..20u64 {
        stamp_back(&d, Duration::from_secs(100 + round));
        let began = std::time::Instant::now();
        assert!(b.refresh().unwrap());
        relisting += began.elapsed();
    }
    let mut listing = Duration::ZERO;
    let rounds = 20;
    for round in 0..rounds {
        let tokens: Vec<i32> = (0..2000).map(|i| i + 10_000 + round).collect();
        let t = saved(&d, 1000 + round as u64, &tokens, 64);
        a.admit(&t, 1, &tokens, usize::MAX).unwrap();
        stamp_back(&d, Duration::from_secs(20 + round as u64));
        let began = std::time::Instant::now();
        assert!(b.refresh().unwrap());
        listing += began.elapsed();
    }
    assert_eq!(b.count(), 220);
    // A restore's private copy of a 32 MiB state (checked and marked), against the CRC-32
    // check alone that a restore made before states were shared.
    let tokens: Vec<i32> = (0..2000).map(|i| i + 50_000).collect();
    let t = Store::temp_name(5000);
    std::fs::write(d.join(&t), state_data(&tokens, &vec![3u8; 32 << 20])).unwrap();
    a.admit(&t, 1, &tokens, 1000).unwrap();
    let (big, _) = a.best(&tokens).unwrap();
    let temp = Store::restore_temp_name(5000);
    let began = std::time::Instant::now();
    let copied = copy::private(&d, &big, 1000, &temp).unwrap();
    let copying = began.elapsed();
    assert_eq!(copied, Source::Copy { marked: true });
    std::fs::remove_file(d.join(&temp)).unwrap();
    let began = std::time::Instant::now();
    let data = std::fs::read(d.join(Store::file_name(&big))).unwrap();
    assert_ne!(crc32fast::hash(&data), 0);
    let checking = began.elapsed();
    println!(
        "a look at the folder of 200 states: {unchanged:?} unchanged (one stat); {:?} changed, nothing new (a listing); {:?} when another serve added a state of 2,000 tokens (a listing, its description read)",
        relisting / 20,
        listing / rounds as u32
    );
    println!(
        "a restore's private copy of a 32 MiB state: {copying:?} (the CRC-32 check alone: {checking:?})"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// The environment variable that makes this test binary one of the serves of
/// [`several_serves_saving_restoring_and_evicting_in_one_folder_keep_every_state_whole`]:
/// `<folder>:<serve number>`.
const SERVE_OF_THE_FOLDER: &str = "ONEBIT_PROMPT_CACHE_TEST_SERVE";
const SERVES: usize = 4;
const SAVES: usize = 250;
const CONVERSATIONS: i32 = 12;

/// The tokens of a conversation at a turn, and its state's "KV": a function of its tokens, so
/// any state read back can be checked byte for byte.
fn conversation(c: i32, turn: usize) -> Vec<i32> {
    (0..48 + 24 * turn as i32).map(|i| c * 1000 + i).collect()
}

fn kv_of(tokens: &[i32]) -> Vec<u8> {
    let seed = tokens
        .iter()
        .fold(17u32, |h, t| h.wrapping_mul(31).wrapping_add(*t as u32));
    (0..20_000 + 40 * tokens.len() as u32)
        .map(|i| (seed.wrapping_add(i.wrapping_mul(2_654_435_761)) >> 13) as u8)
        .collect()
}

/// One serve of the folder: a thread saving (as llama-server writes a state, then its admit
/// under the store's lock), and one restoring as requests do (a look at the folder, the best
/// state, its private copy without the lock), each copy checked byte for byte against what
/// its tokens say it holds. Several serves save the same conversation at about the same
/// time; the budget (about six states) makes every save evict. No serve ever discards a file:
/// none it reads is half written.
fn serve_of_the_folder(dir: &Path, me: usize) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let store = Arc::new(Mutex::new(Store::open(dir, 150_000, identity(2048))));
    let done = Arc::new(AtomicBool::new(false));
    let restorer = {
        let (store, done, dir) = (store.clone(), done.clone(), dir.to_path_buf());
        std::thread::spawn(move || {
            let (mut restored, mut gone, mut seq) = (0, 0, 0);
            while !done.load(Ordering::Relaxed) {
                seq += 1;
                let c = (seq % CONVERSATIONS as u64) as i32;
                let best = {
                    let mut store = store.lock().unwrap();
                    store.refresh().unwrap();
                    let news = store.take_news();
                    assert!(news.discarded.is_empty(), "serve {me}: {news:?}");
                    store.best(&conversation(c, 3))
                };
                let Some((entry, _)) = best else { continue };
                let temp = Store::restore_temp_name(seq);
                let marked = seq % 2 == 0;
                let k = if marked { 8 } else { entry.tokens.len() };
                match copy::private(&dir, &entry, k, &temp) {
                    Ok(Source::Copy { marked: m }) => {
                        assert_eq!(m, marked);
                        let copy = std::fs::read(dir.join(&temp)).unwrap();
                        let mut expected = state_data(&entry.tokens, &kv_of(&entry.tokens));
                        if marked {
                            expected[12 + 4 * 11..12 + 4 * 12]
                                .copy_from_slice(&copy[12 + 4 * 11..12 + 4 * 12]);
                        }
                        assert!(
                            copy == expected,
                            "serve {me}: {} read back not whole and exact",
                            entry.name
                        );
                        restored += 1;
                    }
                    Err(Unusable::Gone) => gone += 1,
                    other => panic!("serve {me}: {} read back: {other:?}", entry.name),
                }
                let _ = std::fs::remove_file(dir.join(&temp));
            }
            (restored, gone)
        })
    };
    let mut kept = 0;
    for n in 0..SAVES {
        let c = ((me + n) % CONVERSATIONS as usize) as i32;
        let tokens = conversation(c, n % 4);
        let temp = Store::temp_name(n as u64);
        std::fs::write(dir.join(&temp), state_data(&tokens, &kv_of(&tokens))).unwrap();
        let admitted = {
            let mut store = store.lock().unwrap();
            let admitted = store.admit(&temp, 8, &tokens, usize::MAX).unwrap();
            let news = store.take_news();
            assert!(news.discarded.is_empty(), "serve {me}: {news:?}");
            admitted
        };
        kept += usize::from(matches!(admitted, Admitted::Kept { .. }));
    }
    done.store(true, Ordering::Relaxed);
    let (restored, gone) = restorer.join().unwrap();
    println!(
        "serve {me}: {kept} of {SAVES} saves kept, {restored} restores whole and exact, {gone} states gone before they were opened"
    );
}

#[test]
fn several_serves_saving_restoring_and_evicting_in_one_folder_keep_every_state_whole() {
    if let Ok(serve) = std::env::var(SERVE_OF_THE_FOLDER) {
        let (dir, me) = serve.rsplit_once(':').unwrap();
        serve_of_the_folder(Path::new(dir), me.parse().unwrap());
        return;
    }
    let d = dir("fleet");
    let name = format!(
        "{}::several_serves_saving_restoring_and_evicting_in_one_folder_keep_every_state_whole",
        module_path!().split_once("::").unwrap().1
    );
    // This test binary itself, run as each serve: they end with the test, and a test process
    // needs none of onebit_process's stop sequence.
    #[allow(clippy::disallowed_methods)]
    let serves: Vec<std::process::Child> = (0..SERVES)
        .map(|me| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
                .env(SERVE_OF_THE_FOLDER, format!("{}:{me}", d.display()))
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for serve in serves {
        let out = serve.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines().filter_map(|l| l.split_once("serve ")) {
            println!("serve {}", line.1);
        }
        assert!(
            out.status.success(),
            "a serve of the folder failed:\n{text}"
        );
        assert!(text.contains("restores whole and exact"), "{text}");
    }
    // Afterwards: every state in the folder read back whole and exact, the folder within its
    // budget, and no serve's temporary file left.
    let (store, news) = open(&d, 150_000, identity(2048));
    assert!(news.discarded.is_empty(), "{news:?}");
    assert!(store.count() > 0);
    for c in 0..CONVERSATIONS {
        if let Some((entry, _)) = store.best(&conversation(c, 3)) {
            let data = read_back(&d, &entry).unwrap();
            assert!(data == state_data(&entry.tokens, &kv_of(&entry.tokens)));
        }
    }
    assert!(store.folder_bytes() <= 150_000);
    let temps: Vec<String> = files(&d)
        .into_iter()
        .filter(|f| f.starts_with("tmp-"))
        .collect();
    assert!(temps.is_empty(), "{temps:?}");
    std::fs::remove_dir_all(&d).unwrap();
}
