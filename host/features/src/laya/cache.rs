//! The conversations already decided, by the hash of their opening: a bounded map that drops
//! the least recently used conversation when full.

use std::collections::{BTreeMap, HashMap};

/// Up to `capacity` values by key; a lookup counts as a use.
pub struct Recent<V> {
    capacity: usize,
    clock: u64,
    entries: HashMap<u64, (V, u64)>,
    /// Last use → key, so the oldest is found without a scan.
    by_use: BTreeMap<u64, u64>,
}

impl<V: Clone> Recent<V> {
    pub fn new(capacity: usize) -> Self {
        Recent {
            capacity: capacity.max(1),
            clock: 0,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
        }
    }

    /// The value for `key`, marked as just used.
    pub fn get(&mut self, key: u64) -> Option<V> {
        self.clock += 1;
        let now = self.clock;
        let (value, used) = self.entries.get_mut(&key)?;
        self.by_use.remove(used);
        *used = now;
        self.by_use.insert(now, key);
        Some(value.clone())
    }

    /// Keep `value` for `key`, dropping the least recently used entry when full.
    pub fn insert(&mut self, key: u64, value: V) {
        self.clock += 1;
        let now = self.clock;
        if let Some((_, used)) = self.entries.remove(&key) {
            self.by_use.remove(&used);
        } else if self.entries.len() >= self.capacity
            && let Some((_, oldest)) = self.by_use.pop_first()
        {
            self.entries.remove(&oldest);
        }
        self.entries.insert(key, (value, now));
        self.by_use.insert(now, key);
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_least_recently_used_out() {
        let mut c = Recent::new(3);
        for k in 0..3 {
            c.insert(k, k * 10);
        }
        assert_eq!(c.get(0), Some(0)); // 0 is now the most recent; 1 the oldest
        c.insert(3, 30);
        assert_eq!(c.len(), 3);
        assert_eq!(c.get(1), None, "the least recently used went");
        assert_eq!(
            (c.get(0), c.get(2), c.get(3)),
            (Some(0), Some(20), Some(30))
        );
        c.insert(2, 21); // a known key is replaced, not added
        assert_eq!(c.len(), 3);
        assert_eq!(c.get(2), Some(21));
    }

    #[test]
    fn the_bound_holds_at_the_default_size() {
        let mut c = Recent::new(super::super::CONVERSATIONS);
        for k in 0..10_000u64 {
            c.insert(k, ());
        }
        assert_eq!(c.len(), 4096);
        assert!(c.get(10_000 - 4096).is_some() && c.get(10_000 - 4097).is_none());
    }
}
