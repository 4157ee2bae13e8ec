//! Tests of the slot file format and prompt caching.

use super::*;

#[test]
fn saved_tokens_restore_in_packed_and_plain_form() {
    let tokens = vec![5, 6, 7];
    assert_eq!(decode(&encode(&tokens), 4096).unwrap(), tokens);
    let mut plain = Vec::new();
    for w in [SEQ_MAGIC, SEQ_VERSION, 2, 9, 10] {
        plain.extend_from_slice(&w.to_le_bytes());
    }
    plain.extend_from_slice(b"kv section ignored");
    assert_eq!(decode(&plain, 4096).unwrap(), [9, 10]);
    assert!(decode(&plain, 1).is_err());
    assert!(decode(b"garbage!!!!!!!!!", 4096).is_err());
}

#[test]
fn a_cached_prefix_still_evaluates_one_token() {
    let mut slot = Slot::default();
    assert_eq!(slot.start(1, &[1, 2, 3], true), 0);
    assert_eq!(slot.start(2, &[1, 2, 3], true), 2);
    assert_eq!(slot.start(3, &[1, 2, 4, 5], true), 2);
    assert_eq!(slot.start(4, &[1, 2, 4, 5], false), 0);
}
