//! One copy of each string many workloads repeat: namespaces, service
//! accounts, the trust domain, node names, cluster and network names,
//! canonical names and revisions, service keys, localities. A workload
//! translated from istiod holds these as [`SharedStr`] taken from
//! [`Strings`], so ten thousand pods of one namespace hold its name once
//! (each field also shrinks from a `String`'s 24 bytes to 8), and its
//! locality as one shared [`Locality`] (8 bytes where three strings took
//! 48). Values no workload holds any more are dropped as [`Interner`]
//! sweeps.

use std::sync::Arc;

use dataplane_core::intern::Interner;

use super::{Locality, SharedStr};

/// Smallest table size swept.
const MIN_SWEEP: usize = 256;

/// The shared strings and localities.
#[derive(Debug)]
pub struct Strings {
    strings: Interner<Arc<str>>,
    names: Interner<SharedStr>,
    localities: Interner<Arc<Locality>>,
}

impl Default for Strings {
    fn default() -> Self {
        Strings {
            strings: Interner::new(MIN_SWEEP),
            names: Interner::new(MIN_SWEEP),
            localities: Interner::new(MIN_SWEEP),
        }
    }
}

impl Strings {
    /// The held copy of `value` (holding one if none is).
    pub fn get(&mut self, value: &str) -> Arc<str> {
        match self.strings.get(value) {
            Some(held) => held,
            None => self.strings.intern(Arc::from(value)),
        }
    }

    /// The held copy of `value` as a workload's field holds it (one
    /// pointer); the empty string holds nothing.
    pub fn name(&mut self, value: &str) -> SharedStr {
        if value.is_empty() {
            return SharedStr::default();
        }
        match self.names.get(value) {
            Some(held) => held,
            None => self.names.intern(SharedStr::from(value)),
        }
    }

    /// The held copy of `locality`; none for an empty one (the usual
    /// single-zone cluster's workloads hold nothing).
    pub fn locality(&mut self, locality: Locality) -> Option<Arc<Locality>> {
        (!locality.is_empty()).then(|| self.localities.intern(Arc::new(locality)))
    }

    /// Strings held.
    pub fn len(&self) -> usize {
        self.strings.len() + self.names.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.strings.is_empty() && self.names.is_empty()
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

    #[test]
    fn equal_localities_share_one_copy_and_an_empty_one_is_none() {
        let mut strings = Strings::default();
        let zone = |zone: &str| Locality {
            region: "eu".into(),
            zone: zone.into(),
            subzone: "".into(),
        };
        let (a, b) = (
            strings.locality(zone("eu-1")),
            strings.locality(zone("eu-1")),
        );
        assert!(matches!((&a, &b), (Some(a), Some(b)) if Arc::ptr_eq(a, b)));
        assert_eq!(
            strings.locality(zone("eu-2")).map(|l| l.zone.clone()),
            Some("eu-2".into())
        );
        assert!(strings.locality(Locality::default()).is_none());
    }
}
