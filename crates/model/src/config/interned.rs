//! One copy of each string many workloads repeat: namespaces, service
//! accounts, the trust domain, node names, cluster and network names,
//! canonical names and revisions, localities. A workload translated from
//! istiod holds these as [`Arc<str>`] taken from [`Strings`], so ten
//! thousand pods of one namespace hold its name once (each field also
//! shrinks from 24 bytes to 16). Strings no workload holds any more are
//! dropped as [`Interner`] sweeps.

use std::sync::Arc;

use dataplane_core::intern::Interner;

/// Smallest table size swept.
const MIN_SWEEP: usize = 256;

/// The shared strings.
#[derive(Debug)]
pub struct Strings(Interner<Arc<str>>);

impl Default for Strings {
    fn default() -> Self {
        Strings(Interner::new(MIN_SWEEP))
    }
}

impl Strings {
    /// The held copy of `value` (holding one if none is).
    pub fn get(&mut self, value: &str) -> Arc<str> {
        match self.0.get(value) {
            Some(held) => held,
            None => self.0.intern(Arc::from(value)),
        }
    }

    /// Strings held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
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
