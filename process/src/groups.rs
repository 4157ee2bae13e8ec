//! The process groups the keeper holds, in memory it never allocates (it runs after a fork).

/// The most process groups the keeper holds at once; a group learned beyond them is not
/// remembered (serve starts a handful).
pub(crate) const CAPACITY: usize = 1024;

/// How often, while it holds any, the keeper drops the groups that emptied.
pub(crate) const PRUNE_EVERY_MS: i32 = 1000;

/// The groups the keeper holds: a fixed array, so the forked keeper never allocates.
pub(crate) struct Groups {
    ids: [i32; CAPACITY],
    len: usize,
}

impl Groups {
    pub(crate) const fn new() -> Groups {
        Groups {
            ids: [0; CAPACITY],
            len: 0,
        }
    }

    /// Remember `group` (a positive id, once); false when it is full.
    pub(crate) fn learn(&mut self, group: i32) -> bool {
        if group <= 0 || self.ids[..self.len].contains(&group) {
            return true;
        }
        let Some(slot) = self.ids.get_mut(self.len) else {
            return false;
        };
        *slot = group;
        self.len += 1;
        true
    }

    /// Forget every group for which `exists` is false.
    pub(crate) fn retain(&mut self, mut exists: impl FnMut(i32) -> bool) {
        let mut kept = 0;
        for i in 0..self.len {
            let group = self.ids[i];
            if exists(group) {
                self.ids[kept] = group;
                kept += 1;
            }
        }
        self.len = kept;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn ids(&self) -> &[i32] {
        &self.ids[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_learned_once_and_forgotten_when_gone() {
        let mut groups = Groups::new();
        assert!(groups.is_empty());
        for g in [7, 8, 7, 0, -3, 9] {
            assert!(groups.learn(g));
        }
        assert_eq!(groups.ids(), &[7, 8, 9]);
        groups.retain(|g| g != 8);
        assert_eq!(groups.ids(), &[7, 9]);
        let mut full = Groups::new();
        for g in 1..=CAPACITY as i32 {
            assert!(full.learn(g));
        }
        assert!(!full.learn(CAPACITY as i32 + 1), "a full keeper says so");
        full.retain(|g| g > 1);
        assert!(full.learn(CAPACITY as i32 + 1), "room once one is gone");
    }
}
