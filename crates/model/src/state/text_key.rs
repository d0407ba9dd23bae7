//! Keys of texts (service keys, hostnames) ordered by a hash of the text
//! first, and the borrowed form a lookup uses so that finding a key from a
//! `&str` copies nothing.

/// A service key (`namespace/hostname`) or a hostname as the index holds
/// it: with a hash of its text, and ordered by that hash first. A lookup
/// then compares the eight bytes held in each B-tree node it passes, not
/// texts held elsewhere in memory (cold between two pushes: comparing
/// them was most of the index's share of a push at 50k workloads); the
/// texts only when two hashes tie. The hash is seeded the same in every
/// run, so a mesh's index has the same shape each time; no one depends on
/// the order, which is the hashes'.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TextKey {
    hash: u64,
    text: Box<str>,
}

impl TextKey {
    /// `text` as a key.
    pub fn new(text: &str) -> Self {
        Self {
            hash: text_hash(text),
            text: text.into(),
        }
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// The hash a [`TextKey`] of `text` holds.
fn text_hash(text: &str) -> u64 {
    std::hash::BuildHasher::hash_one(&foldhash::quality::FixedState::with_seed(0x5e41_1ce5), text)
}

/// A [`TextKey`]'s parts, whoever holds the text: lets a lookup on the
/// connection path ([`ServiceIndex::by_hostname`]) find a key from a
/// borrowed `&str` without copying it into a [`TextKey`] first.
pub(super) trait TextKeyParts {
    /// The text's hash.
    fn hash(&self) -> u64;
    /// The text.
    fn text(&self) -> &str;
}

impl TextKeyParts for TextKey {
    fn hash(&self) -> u64 {
        self.hash
    }

    fn text(&self) -> &str {
        &self.text
    }
}

/// A lookup's key, borrowing its text.
pub(super) struct TextProbe<'a> {
    hash: u64,
    text: &'a str,
}

impl<'a> TextProbe<'a> {
    pub(super) fn new(text: &'a str) -> Self {
        Self {
            hash: text_hash(text),
            text,
        }
    }

    /// As the maps' borrowed key form.
    pub(super) fn as_key(&self) -> &(dyn TextKeyParts + 'a) {
        self
    }
}

impl TextKeyParts for TextProbe<'_> {
    fn hash(&self) -> u64 {
        self.hash
    }

    fn text(&self) -> &str {
        self.text
    }
}

impl<'a> std::borrow::Borrow<dyn TextKeyParts + 'a> for TextKey {
    fn borrow(&self) -> &(dyn TextKeyParts + 'a) {
        self
    }
}

// The order (hash, then text) is `TextKey`'s derived one, as `Borrow`
// requires of the two forms.
impl Ord for dyn TextKeyParts + '_ {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.hash(), self.text()).cmp(&(other.hash(), other.text()))
    }
}

impl PartialOrd for dyn TextKeyParts + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for dyn TextKeyParts + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for dyn TextKeyParts + '_ {}

#[cfg(test)]
mod tests {
    use super::{TextKey, TextProbe};

    /// A probe finds exactly the key of its text, so the two forms order
    /// alike: were they to differ, the B-tree search would miss keys.
    #[test]
    fn a_probe_finds_the_key_of_its_text_and_no_other() {
        let texts: Vec<String> = (0..2000)
            .map(|i| format!("ns{}/svc-{i}.example", i % 7))
            .collect();
        let mut map = imbl::OrdMap::new();
        for (i, text) in texts.iter().enumerate() {
            map.insert(TextKey::new(text), i);
        }
        for (i, text) in texts.iter().enumerate() {
            assert_eq!(map.get(TextProbe::new(text).as_key()), Some(&i), "{text}");
        }
        assert_eq!(map.get(TextProbe::new("ns0/absent.example").as_key()), None);
        assert_eq!(map.get(TextProbe::new("").as_key()), None);
    }
}
