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

/// A persistent hash map with foldhash: the keys come from the operator's
/// file and istiod, not from strangers, and every connection and every
/// push hashes them (SipHash was a fifth of a push's CPU at 10k workloads).
pub type PMap<K, V> =
    imbl::GenericHashMap<K, V, foldhash::fast::RandomState, imbl::shared_ptr::DefaultSharedPtr>;

/// A new empty [`PMap`].
pub fn pmap<K, V>() -> PMap<K, V>
where
    K: std::hash::Hash + Eq + Clone,
    V: Clone,
{
    PMap::with_hasher(foldhash::fast::RandomState::default())
}

/// Several entries under one lookup key (a hostname two services share, a
/// service's endpoints), ordered by [`EntryKey`]; a lookup that wants one
/// takes the last (the entry that came last in the merged configuration,
/// as when the state was a list built in that order).
#[derive(Debug, Clone)]
pub struct Multi<K: std::hash::Hash + Eq + Clone, V: Clone> {
    map: PMap<K, Values<V>>,
}

impl<K: std::hash::Hash + Eq + Clone, V: Clone> Default for Multi<K, V> {
    fn default() -> Self {
        Self { map: pmap() }
    }
}

impl<K: std::hash::Hash + Eq + Clone, V: Clone> Multi<K, V> {
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
        Q: std::hash::Hash + Eq + ?Sized,
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
        Q: std::hash::Hash + Eq + ?Sized,
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
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.map.get(key)?.last()
    }
}

/// The values under one key of a [`Multi`], by entry. Nearly every key
/// has one (a service's hostname, its definition, a policy's key), held
/// inline: a one-entry `imbl::OrdMap` allocated a sixteen-slot leaf of
/// about 530 bytes for it (`benches/mesh_memory.rs`).
#[derive(Debug, Clone)]
pub enum Values<V: Clone> {
    /// One entry's value.
    One(EntryKey, V),
    /// Any number of entries' values (none only while being emptied).
    Many(imbl::OrdMap<EntryKey, V>),
}

impl<V: Clone> Default for Values<V> {
    fn default() -> Self {
        Self::Many(imbl::OrdMap::new())
    }
}

impl<V: Clone> Values<V> {
    /// Adds (or replaces) `entry`'s value.
    fn insert(&mut self, entry: EntryKey, value: V) {
        match self {
            Self::One(held, held_value) if *held == entry => *held_value = value,
            Self::One(held, held_value) => {
                let mut many = imbl::OrdMap::unit(held.clone(), held_value.clone());
                many.insert(entry, value);
                *self = Self::Many(many);
            }
            Self::Many(many) if many.is_empty() => *self = Self::One(entry, value),
            Self::Many(many) => {
                many.insert(entry, value);
            }
        }
    }

    /// Removes `entry`'s value, going back inline when one is left.
    fn remove(&mut self, entry: &EntryKey) {
        match self {
            Self::One(held, _) if held == entry => *self = Self::Many(imbl::OrdMap::new()),
            Self::One(..) => {}
            Self::Many(many) => {
                many.remove(entry);
                if many.len() == 1
                    && let Some((entry, value)) = many.get_min()
                {
                    *self = Self::One(entry.clone(), value.clone());
                }
            }
        }
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        match self {
            Self::One(..) => false,
            Self::Many(many) => many.is_empty(),
        }
    }

    /// The value of `entry`.
    pub fn get(&self, entry: &EntryKey) -> Option<&V> {
        match self {
            Self::One(held, value) => (held == entry).then_some(value),
            Self::Many(many) => many.get(entry),
        }
    }

    /// The value of the last entry.
    pub fn last(&self) -> Option<&V> {
        match self {
            Self::One(_, value) => Some(value),
            Self::Many(many) => many.get_max().map(|(_, v)| v),
        }
    }

    /// Each entry and its value, in entry order.
    pub fn iter(&self) -> impl Iterator<Item = (&EntryKey, &V)> {
        let (one, many) = match self {
            Self::One(entry, value) => (Some((entry, value)), None),
            Self::Many(many) => (None, Some(many.iter())),
        };
        one.into_iter().chain(many.into_iter().flatten())
    }

    /// Each value, in entry order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, value)| value)
    }
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
}
