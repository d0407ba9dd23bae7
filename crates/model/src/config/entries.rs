//! Where an entry of the merged configuration comes from, as the key it is
//! held under, and the persistent maps the mesh state is made of.
//!
//! Every index of [`crate::state::MeshState`] is a persistent map
//! ([`imbl`]): a new state is the previous one with the changed entries
//! replaced, sharing every node a change does not touch, so a push from
//! istiod costs what it names (see [`crate::state::Changes`]) while
//! connections keep reading the state in force.

use std::sync::Arc;

/// An entry's place in the merged configuration: the file's entries in
/// file order, then istiod's in resource-name order. Two entries that
/// claim the same lookup key (a hostname, a policy key) are decided by
/// this order, the same way whether the state was built whole or changed
/// one entry at a time.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntryKey {
    /// The file's entry at this position (of its list).
    File(u32),
    /// istiod's resource of this name.
    Xds(Arc<str>),
}

impl EntryKey {
    /// istiod's resource `name` (shared with every other holder of the
    /// name when given as an `Arc<str>`).
    pub fn xds(name: impl Into<Arc<str>>) -> Self {
        Self::Xds(name.into())
    }

    /// The file's entry at `index`.
    pub fn file(index: usize) -> Self {
        Self::File(u32::try_from(index).unwrap_or(u32::MAX))
    }

    /// Whether the entry is the file's.
    pub fn is_file(&self) -> bool {
        matches!(self, Self::File(_))
    }
}

/// The kinds of entries, in the order istiod's are resolved against one
/// another (a workload keeps an address a service also claims).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntryKind {
    /// A workload.
    Workload,
    /// A service.
    Service,
    /// An authorization policy.
    Policy,
}

/// One of istiod's entries: its kind and resource name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct XdsEntry {
    /// Its kind.
    pub kind: EntryKind,
    /// istiod's resource name.
    pub name: Arc<str>,
}

impl XdsEntry {
    /// The entry `name` of `kind` (the name shared when given as an
    /// `Arc<str>`).
    pub fn new(kind: EntryKind, name: impl Into<Arc<str>>) -> Self {
        Self {
            kind,
            name: name.into(),
        }
    }
}

/// Where a note about an entry of istiod's left out (wholly or in part)
/// sorts: what translating each resource left out, by name, before the
/// address conflicts resolved between resources, workloads before
/// services (the order the whole translation reports them in).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DropKey {
    /// Left out translating resource `name` (any kind).
    Translation(String),
    /// Left out resolving an address conflict.
    Conflict(XdsEntry),
}

/// Notes on what was left out, by entry, in the order they are shown.
pub type Dropped = imbl::OrdMap<DropKey, Arc<[String]>>;

/// Several entries under one lookup key (a hostname two services share, a
/// service's endpoints), ordered by [`EntryKey`]. The keys are in a
/// B-tree, not a hash trie: imbl's trie allocates every node at its full
/// 32 slots, which at 5k services took about 1 KB a service, and its
/// shape (so its memory) changed from run to run with the hash seed; a
/// lookup costs some 40 ns more (`benches/hot_paths.rs`). a lookup that wants one
/// takes the last (the entry that came last in the merged configuration,
/// as when the state was a list built in that order).
#[derive(Debug, Clone)]
pub struct Multi<K: Ord + Clone, V: Clone> {
    map: imbl::OrdMap<K, Values<V>>,
}

impl<K: Ord + Clone, V: Clone> Default for Multi<K, V> {
    fn default() -> Self {
        Self {
            map: imbl::OrdMap::new(),
        }
    }
}

impl<K: Ord + Clone, V: Clone> Multi<K, V> {
    /// Adds (or replaces) `entry`'s value under `key`.
    pub fn insert(&mut self, key: K, entry: EntryKey, value: V) {
        match self.map.get_mut(&key) {
            Some(values) => values.insert(entry, value),
            None => {
                self.map.insert(key, Values::One(entry, value));
            }
        }
    }

    /// Removes `entry`'s value under `key`.
    pub fn remove<Q>(&mut self, key: &Q, entry: &EntryKey)
    where
        K: std::borrow::Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let Some(values) = self.map.get_mut(key) else {
            return;
        };
        values.remove(entry);
        if values.is_empty() {
            self.map.remove(key);
        }
    }

    /// The values under `key`, in entry order.
    pub fn all<Q>(&self, key: &Q) -> Option<&Values<V>>
    where
        K: std::borrow::Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.map.get(key)
    }

    /// Every key with its values, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &Values<V>)> {
        self.map.iter()
    }

    /// Whether no key has a value.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The value of the last entry under `key`.
    pub fn last<Q>(&self, key: &Q) -> Option<&V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.map.get(key)?.last()
    }
}

/// A key's values are held in a slice up to this many entries, in a
/// persistent map above it.
const FEW: usize = 32;
/// A key's values held in a map go back to a slice at this many (not at
/// [`FEW`], so a key at the line does not convert at each change).
const FEW_AGAIN: usize = 16;

/// The values under one key of a [`Multi`], by entry. Nearly every key
/// has one (a service's hostname, its definition, a policy's key), held
/// inline: a one-entry `imbl::OrdMap` allocated a sixteen-slot leaf of
/// about 530 bytes for it. A few (a service's members, ten in issue 31's
/// meshes) are a shared sorted slice: the map's 64-slot node took about
/// 2.5 KB for ten, a quarter of each service's memory
/// (`benches/mesh_memory.rs`), and a change copies at most [`FEW`]
/// entries of a pointer or two.
#[derive(Debug, Clone)]
pub enum Values<V: Clone> {
    /// One entry's value.
    One(EntryKey, V),
    /// Up to [`FEW`] entries' values, sorted by entry (none only while
    /// being emptied).
    Few(Arc<[(EntryKey, V)]>),
    /// Any number of entries' values.
    Many(imbl::OrdMap<EntryKey, V>),
}

impl<V: Clone> Default for Values<V> {
    fn default() -> Self {
        Self::Few(Arc::from([]))
    }
}

impl<V: Clone> Values<V> {
    /// Adds (or replaces) `entry`'s value.
    fn insert(&mut self, entry: EntryKey, value: V) {
        match self {
            Self::One(held, held_value) if *held == entry => *held_value = value,
            Self::One(held, held_value) => {
                let held = (held.clone(), held_value.clone());
                let pair = if held.0 < entry {
                    [held, (entry, value)]
                } else {
                    [(entry, value), held]
                };
                *self = Self::Few(Arc::from(pair));
            }
            Self::Few(few) => match few.binary_search_by(|(held, _)| held.cmp(&entry)) {
                Ok(at) => match Arc::get_mut(few) {
                    Some(unshared) => unshared[at].1 = value,
                    None => *few = spliced(few, at, 1, Some((entry, value))),
                },
                Err(_) if few.is_empty() => *self = Self::One(entry, value),
                Err(at) if few.len() < FEW => *few = spliced(few, at, 0, Some((entry, value))),
                Err(_) => {
                    let mut many: imbl::OrdMap<EntryKey, V> = few.iter().cloned().collect();
                    many.insert(entry, value);
                    *self = Self::Many(many);
                }
            },
            Self::Many(many) => {
                many.insert(entry, value);
            }
        }
    }

    /// Removes `entry`'s value, going back inline when one is left.
    fn remove(&mut self, entry: &EntryKey) {
        match self {
            Self::One(held, _) if held == entry => *self = Self::default(),
            Self::One(..) => {}
            Self::Few(few) => {
                if let Ok(at) = few.binary_search_by(|(held, _)| held.cmp(entry)) {
                    *self = if few.len() == 2 {
                        let (entry, value) = few[1 - at].clone();
                        Self::One(entry, value)
                    } else {
                        Self::Few(spliced(few, at, 1, None))
                    };
                }
            }
            Self::Many(many) => {
                many.remove(entry);
                if many.len() <= FEW_AGAIN {
                    *self = match many.get_min() {
                        Some((entry, value)) if many.len() == 1 => {
                            Self::One(entry.clone(), value.clone())
                        }
                        _ => Self::Few(many.iter().map(|(e, v)| (e.clone(), v.clone())).collect()),
                    };
                }
            }
        }
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        match self {
            Self::One(..) => false,
            Self::Few(few) => few.is_empty(),
            Self::Many(many) => many.is_empty(),
        }
    }

    /// The value of `entry`.
    pub fn get(&self, entry: &EntryKey) -> Option<&V> {
        match self {
            Self::One(held, value) => (held == entry).then_some(value),
            Self::Few(few) => few
                .binary_search_by(|(held, _)| held.cmp(entry))
                .ok()
                .map(|at| &few[at].1),
            Self::Many(many) => many.get(entry),
        }
    }

    /// The value of the last entry.
    pub fn last(&self) -> Option<&V> {
        match self {
            Self::One(_, value) => Some(value),
            Self::Few(few) => few.last().map(|(_, v)| v),
            Self::Many(many) => many.get_max().map(|(_, v)| v),
        }
    }

    /// Each entry and its value, in entry order.
    pub fn iter(&self) -> impl Iterator<Item = (&EntryKey, &V)> {
        let (one, few, many) = match self {
            Self::One(entry, value) => (Some((entry, value)), None, None),
            Self::Few(few) => (None, Some(few.iter().map(|(e, v)| (e, v))), None),
            Self::Many(many) => (None, None, Some(many.iter())),
        };
        one.into_iter()
            .chain(few.into_iter().flatten())
            .chain(many.into_iter().flatten())
    }

    /// Each value, in entry order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, value)| value)
    }
}

/// `few` with `removed` entries at `at` replaced by `put`, as a new slice
/// (the old one may be shared with an earlier state).
fn spliced<V: Clone>(
    few: &[(EntryKey, V)],
    at: usize,
    removed: usize,
    put: Option<(EntryKey, V)>,
) -> Arc<[(EntryKey, V)]> {
    let (before, after) = few.split_at(at);
    before
        .iter()
        .cloned()
        .chain(put)
        .chain(after.iter().skip(removed).cloned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_comes_first_then_istiod_by_name_and_the_last_entry_wins() {
        let mut keys = [
            EntryKey::xds("b"),
            EntryKey::file(3),
            EntryKey::xds("a"),
            EntryKey::file(0),
        ];
        keys.sort();
        assert_eq!(
            keys,
            [
                EntryKey::file(0),
                EntryKey::file(3),
                EntryKey::xds("a"),
                EntryKey::xds("b")
            ]
        );
        let mut multi: Multi<String, u8> = Multi::default();
        multi.insert("h".into(), EntryKey::xds("b"), 2);
        multi.insert("h".into(), EntryKey::file(0), 1);
        assert_eq!(multi.last("h"), Some(&2));
        multi.remove("h", &EntryKey::xds("b"));
        assert_eq!(multi.last("h"), Some(&1));
        assert!(matches!(multi.all("h"), Some(Values::One(..))));
        multi.insert("h".into(), EntryKey::file(0), 3);
        assert_eq!(multi.last("h"), Some(&3));
        assert_eq!(multi.all("h").map(|v| v.iter().count()), Some(1));
        multi.remove("h", &EntryKey::file(0));
        assert!(multi.all("h").is_none());
        assert!(multi.last("h").is_none());
    }

    /// Entries added and removed in a scrambled order, across the slice's
    /// and the map's lines both ways, read back as a `BTreeMap` of the same
    /// operations holds them; an earlier copy is left as it was.
    #[test]
    fn values_hold_what_a_map_holds_across_the_lines() {
        let mut multi: Multi<&str, usize> = Multi::default();
        let mut model = std::collections::BTreeMap::new();
        let check = |multi: &Multi<&str, usize>,
                     model: &std::collections::BTreeMap<EntryKey, usize>| {
            let held: Vec<(EntryKey, usize)> = multi
                .all("k")
                .map(|v| v.iter().map(|(e, v)| (e.clone(), *v)).collect())
                .unwrap_or_default();
            let expected: Vec<(EntryKey, usize)> =
                model.iter().map(|(e, v)| (e.clone(), *v)).collect();
            assert_eq!(held, expected);
            assert_eq!(multi.last("k"), model.values().next_back());
            for (entry, value) in model {
                assert_eq!(multi.all("k").and_then(|v| v.get(entry)), Some(value));
            }
            assert_eq!(multi.all("k").is_some(), !model.is_empty());
        };
        // 40 entries in an order no two neighbours are adjacent in.
        let order: Vec<usize> = (0..40).map(|i| (i * 17) % 40).collect();
        for (step, i) in order.iter().enumerate() {
            let entry = EntryKey::xds(format!("e{i:02}"));
            multi.insert("k", entry.clone(), step);
            model.insert(entry, step);
            check(&multi, &model);
        }
        assert!(matches!(multi.all("k"), Some(Values::Many(_))));
        let before = multi.clone();
        let before_model = model.clone();
        // Replace one, then take all away again in another order.
        multi.insert("k", EntryKey::xds("e07"), 99);
        model.insert(EntryKey::xds("e07"), 99);
        check(&multi, &model);
        for i in (0..40).map(|i| (i * 23) % 40) {
            let entry = EntryKey::xds(format!("e{i:02}"));
            multi.remove("k", &entry);
            model.remove(&entry);
            check(&multi, &model);
            match model.len() {
                0 => assert!(multi.all("k").is_none()),
                1 => assert!(matches!(multi.all("k"), Some(Values::One(..)))),
                2..=FEW_AGAIN => assert!(matches!(multi.all("k"), Some(Values::Few(_)))),
                _ => {}
            }
        }
        check(&before, &before_model);
        // A slice shared with a copy is replaced, not written through.
        let mut few: Multi<&str, usize> = Multi::default();
        for i in 0..5 {
            few.insert("k", EntryKey::file(i), i);
        }
        let copy = few.clone();
        few.insert("k", EntryKey::file(2), 7);
        assert_eq!(
            copy.all("k").and_then(|v| v.get(&EntryKey::file(2))),
            Some(&2)
        );
        assert_eq!(
            few.all("k").and_then(|v| v.get(&EntryKey::file(2))),
            Some(&7)
        );
    }
}
