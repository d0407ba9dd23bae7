//! One copy of each value many entries repeat.
//!
//! Ten thousand pods of one namespace name it ten thousand times, and the
//! replicas of a Deployment share one identity: an [`Interner`] hands every
//! holder of an equal value the same shared copy. Values no one but the
//! interner holds any more are dropped once the table has doubled since it
//! was last swept, so the sweep costs O(1) per insertion, and the table
//! never holds more than about twice what its users hold.

use std::{borrow::Borrow, collections::HashSet, hash::Hash, sync::Arc};

/// A value whose copies share one allocation, so a table can tell whether
/// anyone but itself still holds it.
pub trait Shared: Clone {
    /// Whether a copy other than this one exists.
    fn is_shared(&self) -> bool;
}

impl<T: ?Sized> Shared for Arc<T> {
    fn is_shared(&self) -> bool {
        Arc::strong_count(self) > 1
    }
}

/// The held copies of values of type `T` (an `Arc` or a type built on one).
#[derive(Debug)]
pub struct Interner<T> {
    held: HashSet<T, foldhash::fast::RandomState>,
    /// Entries after the last sweep.
    swept_at: usize,
    /// Smallest table size swept: below it a pass is not worth its cost.
    min_sweep: usize,
}

impl<T: Shared + Hash + Eq> Interner<T> {
    /// An empty table that sweeps once it holds at least `min_sweep`
    /// values (and twice what the last sweep left).
    pub fn new(min_sweep: usize) -> Self {
        Interner {
            held: HashSet::default(),
            swept_at: 0,
            min_sweep,
        }
    }

    /// The held copy equal to `value`, if one is held.
    pub fn get<Q>(&self, value: &Q) -> Option<T>
    where
        T: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.held.get(value).cloned()
    }

    /// The held copy equal to `value`, holding `value` itself when none is.
    pub fn intern(&mut self, value: T) -> T {
        if let Some(held) = self.held.get(&value) {
            return held.clone();
        }
        self.held.insert(value.clone());
        // `value` is still ours here, so the sweep keeps it.
        if self.held.len() >= self.min_sweep.max(self.swept_at * 2) {
            self.held.retain(Shared::is_shared);
            self.swept_at = self.held.len();
        }
        value
    }

    /// Values held.
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
    fn equal_values_share_one_copy() {
        let mut table: Interner<Arc<str>> = Interner::new(8);
        let a = table.intern(Arc::from("shop"));
        let b = table.intern(Arc::from("shop"));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(Arc::ptr_eq(
            &a,
            &table.get("shop").unwrap_or_else(|| Arc::from(""))
        ));
        assert!(table.get("web").is_none());
        assert_eq!(table.len(), 1);
    }

    #[test]
    fn values_no_one_holds_are_swept_once_the_table_doubled() {
        const MIN: usize = 16;
        let mut table: Interner<Arc<str>> = Interner::new(MIN);
        let kept: Vec<Arc<str>> = (0..4)
            .map(|i| table.intern(Arc::from(format!("k{i}"))))
            .collect();
        for i in 0..(MIN - 5) {
            drop(table.intern(Arc::from(format!("gone{i}"))));
        }
        assert_eq!(table.len(), MIN - 1, "not swept before the threshold");
        // The one being inserted is held by its caller while the sweep runs.
        let last = table.intern(Arc::from("last"));
        assert_eq!(table.len(), 5, "only the held ones stay");
        for held in &kept {
            assert!(Arc::ptr_eq(held, &table.intern(Arc::clone(held))));
        }
        assert_eq!(&*last, "last");
    }
}
