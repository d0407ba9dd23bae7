//! [`SharedStr`]: a string many workloads repeat, held behind one pointer.

use std::{
    borrow::Borrow,
    cmp::Ordering,
    fmt,
    hash::{Hash, Hasher},
    ops::Deref,
    sync::Arc,
};

use dataplane_core::intern::Shared;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An immutable string whose copies share one allocation, in 8 bytes: an
/// `Arc<str>` is a pointer and a length (16 bytes), and a workload held
/// ten of them, 80 of its bytes (`benches/mesh_memory.rs`). The length
/// lives with the characters instead, one more indirection on a read;
/// the values are the few a cluster's workloads share (namespaces,
/// service accounts, node names, taken from
/// [`super::interned::Strings`]), so the extra allocation is paid once
/// per value. The empty string holds nothing.
///
/// Reads as a `str` (`Deref`, `AsRef`, `Borrow`); compares, orders and
/// hashes as its text.
#[derive(Clone, Default)]
pub struct SharedStr(Option<Arc<Box<str>>>);

impl SharedStr {
    /// The text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Some(held) => held,
            None => "",
        }
    }

    /// Whether both are one allocation (or both empty).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        match (&a.0, &b.0) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }
}

impl Shared for SharedStr {
    fn is_shared(&self) -> bool {
        // The empty string is never held by a table, so never swept.
        self.0
            .as_ref()
            .is_none_or(|held| Arc::strong_count(held) > 1)
    }
}

impl Deref for SharedStr {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for SharedStr {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for SharedStr {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for SharedStr {
    fn from(value: &str) -> Self {
        Self((!value.is_empty()).then(|| Arc::new(Box::from(value))))
    }
}

impl From<String> for SharedStr {
    fn from(value: String) -> Self {
        Self((!value.is_empty()).then(|| Arc::new(value.into_boxed_str())))
    }
}

impl From<&String> for SharedStr {
    fn from(value: &String) -> Self {
        Self::from(value.as_str())
    }
}

impl From<Arc<str>> for SharedStr {
    fn from(value: Arc<str>) -> Self {
        Self::from(&*value)
    }
}

impl From<&SharedStr> for Arc<str> {
    fn from(value: &SharedStr) -> Self {
        Arc::from(value.as_str())
    }
}

impl From<SharedStr> for String {
    fn from(value: SharedStr) -> Self {
        value.as_str().to_owned()
    }
}

impl PartialEq for SharedStr {
    fn eq(&self, other: &Self) -> bool {
        Self::ptr_eq(self, other) || self.as_str() == other.as_str()
    }
}

impl Eq for SharedStr {}

impl PartialEq<str> for SharedStr {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for SharedStr {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for SharedStr {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl PartialOrd for SharedStr {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SharedStr {
    fn cmp(&self, other: &Self) -> Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for SharedStr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `str` hashes, which `Borrow<str>` requires.
        self.as_str().hash(state);
    }
}

impl fmt::Debug for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_str(), f)
    }
}

impl Serialize for SharedStr {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for SharedStr {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_pointer_that_reads_compares_and_hashes_as_its_text() {
        assert_eq!(size_of::<SharedStr>(), size_of::<usize>());
        let a = SharedStr::from("shop");
        let b = SharedStr::from(String::from("shop"));
        assert!(!SharedStr::ptr_eq(&a, &b));
        assert_eq!(a, b);
        assert_eq!(&*a, "shop");
        let (first, second) = (SharedStr::from("a"), SharedStr::from("b"));
        assert!(first < second);
        let hash = |s: &dyn Fn(&mut std::hash::DefaultHasher)| {
            let mut h = std::hash::DefaultHasher::new();
            s(&mut h);
            h.finish()
        };
        assert_eq!(hash(&|h| a.hash(h)), hash(&|h| "shop".hash(h)));
        assert_eq!(format!("{a} {a:?}"), "shop \"shop\"");
        let empty = SharedStr::from("");
        assert!(empty.is_empty() && empty == SharedStr::default());
    }
}
