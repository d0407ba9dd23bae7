//! What the last responses changed, by name: how the mesh model finds
//! the resources a push changed without comparing the held maps (a walk
//! that grows with what is held: `seek_to_first` and the compared leaves
//! were about 6 % of an update's CPU at 100k workloads, more at 1M).
//!
//! Every state [`XdsResources::apply`](super::XdsResources::apply) makes
//! gets an id no other state has; the journal keeps, for the last
//! responses (at most [`MAX_NAMES`] names in all), the state each started
//! from and the names it applied or removed. A later copy can then say
//! which names may differ from an earlier one if the earlier one's state
//! is among those starting points: it is an ancestor, and only those
//! names were touched on the way. Anything else (an earlier copy of
//! another branch or too far back, a response of more names than the
//! journal keeps) is answered with "unknown", and the caller compares
//! the maps whole, as before.
//!
//! The held maps are public and tests change them directly: each copy
//! also keeps the maps as they stood when its state was made, and a map
//! that is no longer the same map (its root shared, [`imbl::OrdMap::ptr_eq`])
//! was changed outside the journal. The kept copy shares the root, so
//! any change through `&mut` copies the root first and cannot go unseen;
//! such a copy answers "unknown" until its next response starts a new
//! history from it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use imbl::ordmap::DiffItem;

use super::resources::{Held, Versioned};
use super::translate::IntoModel;
use crate::istio_api::{security::Authorization, workload::Address};

/// Most names kept (over all the responses kept, each response counting
/// one more). A single-workload update names one or a few; this covers
/// hundreds of updates a consumer may skip while busy, and bounds the
/// journal's memory and the lookups a walk makes. A response naming
/// more (a first state) is not kept: the caller compares the maps.
pub const MAX_NAMES: usize = 1024;

/// Ids of states: 0 is every empty state no response made.
static NEXT_STATE: AtomicU64 = AtomicU64::new(1);

fn new_state() -> u64 {
    NEXT_STATE.fetch_add(1, Ordering::Relaxed)
}

/// Which map a response changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Workloads and services.
    Addresses,
    /// Authorization policies.
    Authorizations,
}

/// One applied response: the state it started from and what it named.
#[derive(Clone)]
struct Step {
    from: u64,
    kind: Kind,
    names: Arc<[Arc<str>]>,
}

/// The names one response applied or removed, up to [`MAX_NAMES`].
#[derive(Debug, Default)]
pub struct Named {
    names: Vec<Arc<str>>,
    /// More than the journal keeps were named.
    overflow: bool,
}

impl Named {
    /// Notes `name` (a key of the map the response changed).
    pub fn push(&mut self, name: &Arc<str>) {
        if self.names.len() < MAX_NAMES {
            self.names.push(Arc::clone(name));
        } else {
            self.overflow = true;
        }
    }
}

/// The names the responses since some earlier state touched (a superset
/// of what changed: a resource sent again unchanged is named too).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Touched {
    /// Names in the addresses map, sorted, each once.
    pub addresses: Vec<Arc<str>>,
    /// Names in the authorizations map, sorted, each once.
    pub authorizations: Vec<Arc<str>>,
}

/// The journal one copy of the held resources carries. Cloning is cheap
/// (persistent vector, shared roots).
#[derive(Clone, Default)]
pub struct Journal {
    /// This copy's state (0: empty, made by no response).
    state: u64,
    /// The maps as they stood when `state` was made.
    addresses_at: Held<Address>,
    authorizations_at: Held<Authorization>,
    /// The last responses, oldest first.
    steps: imbl::Vector<Step>,
    /// Names in `steps`, plus one a step (an empty step is still kept).
    weight: usize,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("state", &self.state)
            .field("steps", &self.steps.len())
            .field("weight", &self.weight)
            .finish()
    }
}

impl Journal {
    /// Whether `addresses` and `authorizations` are the maps this copy's
    /// state was made with (not changed outside the journal since).
    fn intact(&self, addresses: &Held<Address>, authorizations: &Held<Authorization>) -> bool {
        self.addresses_at.ptr_eq(addresses) && self.authorizations_at.ptr_eq(authorizations)
    }

    /// Called before a response changes the maps: if they were changed
    /// outside the journal, what it kept no longer leads here, so it
    /// starts over from a state of its own.
    pub fn begin(&mut self, addresses: &Held<Address>, authorizations: &Held<Authorization>) {
        if !self.intact(addresses, authorizations) {
            self.steps.clear();
            self.weight = 0;
            self.state = new_state();
        }
    }

    /// Called once a response changed the maps to `addresses` and
    /// `authorizations`, having named `names` in the `kind` map.
    pub fn record(
        &mut self,
        kind: Kind,
        named: Named,
        addresses: &Held<Address>,
        authorizations: &Held<Authorization>,
    ) {
        let from = self.state;
        self.state = new_state();
        self.addresses_at = addresses.clone();
        self.authorizations_at = authorizations.clone();
        let Named { names, overflow } = named;
        if overflow {
            // Too many to keep: nothing before this state is reachable.
            // (The weight bound below would drop it too: a full list
            // weighs MAX_NAMES + 1.)
            self.steps.clear();
            self.weight = 0;
            return;
        }
        self.weight += names.len() + 1;
        self.steps.push_back(Step {
            from,
            kind,
            names: names.into(),
        });
        while self.weight > MAX_NAMES {
            let Some(oldest) = self.steps.pop_front() else {
                break;
            };
            self.weight -= oldest.names.len() + 1;
        }
    }

    /// The names touched from `earlier`'s state to this copy's, if this
    /// copy's history reaches back to it and neither copy's maps were
    /// changed outside the journal; `None` when that is not known.
    pub fn touched_since(
        &self,
        maps: (&Held<Address>, &Held<Authorization>),
        earlier: &Journal,
        earlier_maps: (&Held<Address>, &Held<Authorization>),
    ) -> Option<Touched> {
        if !self.intact(maps.0, maps.1) || !earlier.intact(earlier_maps.0, earlier_maps.1) {
            return None;
        }
        let mut touched = Touched::default();
        if earlier.state != self.state {
            let mut reached = false;
            for step in self.steps.iter().rev() {
                let names = match step.kind {
                    Kind::Addresses => &mut touched.addresses,
                    Kind::Authorizations => &mut touched.authorizations,
                };
                names.extend(step.names.iter().cloned());
                if step.from == earlier.state {
                    reached = true;
                    break;
                }
            }
            if !reached {
                return None;
            }
        }
        for names in [&mut touched.addresses, &mut touched.authorizations] {
            names.sort_unstable();
            names.dedup();
        }
        Some(touched)
    }
}

/// One held resource that changed: its name (a key of the map that
/// holds it now, or held it), what was held and what is.
type Change<'a, T> = (
    &'a Arc<str>,
    Option<&'a Arc<Versioned<T>>>,
    Option<&'a Arc<Versioned<T>>>,
);

/// The resources that differ from `old` to `new`, in name order: looked
/// up by `names` (sorted, every changed name among them) when the
/// journal gave them, else found by comparing the two maps (a walk that
/// grows with what is held).
pub fn changed_resources<'a, T: IntoModel>(
    old: &'a Held<T>,
    new: &'a Held<T>,
    names: Option<Vec<Arc<str>>>,
) -> Box<dyn Iterator<Item = Change<'a, T>> + 'a> {
    let Some(names) = names else {
        return Box::new(old.diff(new).map(|item| match item {
            DiffItem::Add(name, new) => (name, None, Some(new)),
            DiffItem::Update {
                old: (_, old),
                new: (name, new),
            } => (name, Some(old), Some(new)),
            DiffItem::Remove(name, old) => (name, Some(old), None),
        }));
    };
    Box::new(names.into_iter().filter_map(move |name| {
        let was = old.get_key_value(&name);
        let is = new.get_key_value(&name);
        match (was, is) {
            // As the diff: equal values (the same `Arc`, or one sent
            // again unchanged) are no change.
            (Some((_, was)), Some((_, is))) if was == is => None,
            (was, Some((name, is))) => Some((name, was.map(|(_, was)| was), Some(is))),
            (Some((name, was)), None) => Some((name, Some(was), None)),
            (None, None) => None,
        }
    }))
}

#[cfg(test)]
#[path = "journal_tests.rs"]
mod tests;
