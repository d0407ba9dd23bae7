//! One copy of each string many workloads repeat: namespaces, service
//! accounts, the trust domain, node names, cluster and network names,
//! canonical names and revisions, localities. A workload translated from
//! istiod holds these as [`Arc<str>`] taken from [`Strings`], so ten
//! thousand pods of one namespace hold its name once (each field also
//! shrinks from 24 bytes to 16). Strings no workload holds any more are dropped once the table has
//! doubled since it was last swept (O(1) per insertion).

use std::{collections::HashSet, sync::Arc};

/// Smallest table size swept.
const MIN_SWEEP: usize = 256;

/// The shared strings.
#[derive(Debug, Default)]
pub struct Strings {
    held: HashSet<Arc<str>, foldhash::fast::RandomState>,
    /// Entries after the last sweep.
    swept_at: usize,
}

impl Strings {
    /// The held copy of `value` (holding one if none is).
    pub fn get(&mut self, value: &str) -> Arc<str> {
        if let Some(held) = self.held.get(value) {
            return Arc::clone(held);
        }
        let held: Arc<str> = Arc::from(value);
        self.held.insert(Arc::clone(&held));
        if self.held.len() >= MIN_SWEEP.max(self.swept_at * 2) {
            // Held only here: no workload refers to it.
            self.held.retain(|s| Arc::strong_count(s) > 1);
            self.swept_at = self.held.len();
        }
        held
    }

    /// Strings held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_share_one_copy_and_unheld_ones_are_swept() {
        let mut strings = Strings::default();
        let (a, b) = (strings.get("shop"), strings.get("shop"));
        assert!(Arc::ptr_eq(&a, &b));
        for i in 0..(MIN_SWEEP - 2) {
            drop(strings.get(&format!("gone{i}")));
        }
        assert_eq!(
            strings.len(),
            MIN_SWEEP - 1,
            "not swept before the threshold"
        );
        let last = strings.get("last");
        assert_eq!(strings.len(), 2, "only the held ones stay");
        assert!(Arc::ptr_eq(&a, &strings.get("shop")));
        assert_eq!(&*last, "last");
    }
}
