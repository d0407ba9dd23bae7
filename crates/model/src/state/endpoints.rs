//! A service's endpoints, changed one member at a time.
//!
//! A workload update names the services it serves; the service's entry is
//! then built again with that one member replaced, inserted or removed.
//! A large service's endpoints are kept in a persistent vector
//! ([`imbl::Vector`], a tree of 64-slot chunks shared with the entry it
//! replaces), so the change copies one chunk per level (about 64 x depth
//! pointers) instead of every endpoint: a service of 1,000 endpoints was
//! rebuilt from all of them for each change of one, touching each
//! workload cold (`benches/xds_update.rs` `large`: 0.42 ms a push, now
//! what a push to a service of ten costs, 0.24 ms). Up to a chunk's worth
//! they are a plain vector, copied whole: the same pointers a chunk's copy
//! touches, in a fifth of the memory (a chunk is 64 slots however few are
//! used: 0.8 MB more at 10,000 workloads in services of ten,
//! `benches/mesh_memory.rs`). ztunnel keeps a service's endpoints in a map
//! by workload uid (`src/state/service.rs` `EndpointSet`) for the same
//! reason; the vector also gives load balancing its position.

use std::sync::Arc;

use super::{EntryKey, MeshWorkload, Values};

/// The endpoints, in entry order, with what weighted choice needs.
#[derive(Debug, Clone, Default)]
pub struct EndpointSet {
    list: List,
    /// The sum of the endpoints' weights (capacities) and of their
    /// squares: they all weigh the same exactly when `n * squares ==
    /// sum^2` (Cauchy-Schwarz), so a change knows whether weights differ
    /// from two counters, without reading every endpoint or allocating.
    moments: (u64, u128),
    /// The endpoints' running sum of weights when they differ.
    sums: Option<Box<[u64]>>,
}

/// A set larger than this is a [`List::Large`] (one chunk's worth).
const SMALL: usize = 64;

/// The endpoints in entry order, by size.
#[derive(Debug, Clone)]
enum List {
    /// At most [`SMALL`] (or, once large, a half of it).
    Small(Vec<Arc<MeshWorkload>>),
    /// More.
    Large(imbl::Vector<Arc<MeshWorkload>>),
}

impl Default for List {
    fn default() -> Self {
        Self::Small(Vec::new())
    }
}

impl List {
    fn len(&self) -> usize {
        match self {
            Self::Small(v) => v.len(),
            Self::Large(v) => v.len(),
        }
    }

    /// Where `entry` is (`Ok`) or would go (`Err`).
    fn find(&self, entry: &EntryKey) -> Result<usize, usize> {
        match self {
            Self::Small(v) => v.binary_search_by(|w| w.key.cmp(entry)),
            Self::Large(v) => v.binary_search_by(|w| w.key.cmp(entry)),
        }
    }

    fn set(&mut self, at: usize, member: Arc<MeshWorkload>) -> Arc<MeshWorkload> {
        match self {
            Self::Small(v) => std::mem::replace(&mut v[at], member),
            Self::Large(v) => v.set(at, member),
        }
    }

    fn insert(&mut self, at: usize, member: Arc<MeshWorkload>) {
        match self {
            Self::Small(v) => v.insert(at, member),
            Self::Large(v) => v.insert(at, member),
        }
    }

    fn remove(&mut self, at: usize) -> Arc<MeshWorkload> {
        match self {
            Self::Small(v) => v.remove(at),
            Self::Large(v) => v.remove(at),
        }
    }

    /// Makes it the kind its size calls for: large above [`SMALL`], small
    /// again at half of it (not at once, so a service whose size goes
    /// back and forth across the line does not convert at each change);
    /// a small one without spare capacity.
    fn resize(&mut self) {
        match self {
            Self::Small(v) if v.len() > SMALL => {
                *self = Self::Large(std::mem::take(v).into_iter().collect());
            }
            Self::Large(v) if v.len() <= SMALL / 2 => {
                *self = Self::Small(v.iter().cloned().collect());
            }
            // Held as long as the state: no room to grow into.
            Self::Small(v) => v.shrink_to_fit(),
            Self::Large(_) => {}
        }
    }

    /// From the `start`th (below the length) to the end, then from the
    /// first to it.
    fn rotated(&self, start: usize) -> impl Iterator<Item = &Arc<MeshWorkload>> {
        let (small, large) = match self {
            Self::Small(v) => (Some(v[start..].iter().chain(&v[..start])), None),
            Self::Large(v) => {
                let tail = v.focus().narrow(start..).into_iter();
                (None, Some(tail.chain(v.focus().narrow(..start))))
            }
        };
        small
            .into_iter()
            .flatten()
            .chain(large.into_iter().flatten())
    }
}

impl EndpointSet {
    /// The members (in entry order) that `serves` keeps.
    pub(super) fn of(
        members: Option<&Values<Arc<MeshWorkload>>>,
        serves: impl Fn(&MeshWorkload) -> bool,
    ) -> Self {
        let mut set = Self::default();
        let mut list = Vec::new();
        for member in members.into_iter().flat_map(Values::values) {
            if serves(member) {
                set.count(member.workload.weight(), true);
                list.push(Arc::clone(member));
            }
        }
        set.list = List::Small(list);
        set.list.resize();
        set.sum();
        set
    }

    /// This set with the members `touched` names brought up to `members`
    /// (a touched entry no longer among them, or that `serves` no longer
    /// keeps, leaves); the rest shared with this one.
    pub(super) fn changed(
        &self,
        touched: &[EntryKey],
        members: Option<&Values<Arc<MeshWorkload>>>,
        serves: impl Fn(&MeshWorkload) -> bool,
    ) -> Self {
        let mut set = Self {
            list: self.list.clone(),
            moments: self.moments,
            sums: None,
        };
        for entry in touched {
            let member = members
                .and_then(|all| all.get(entry))
                .filter(|member| serves(member));
            let held = set.list.find(entry);
            if let Some(member) = member {
                set.count(member.workload.weight(), true);
            }
            // A member that stays one (the usual update) is replaced where
            // it is: an insert or a removal in the middle splits and joins
            // the tree, copying several chunks.
            let gone = match (held, member) {
                (Ok(at), Some(member)) => Some(set.list.set(at, Arc::clone(member))),
                (Ok(at), None) => Some(set.list.remove(at)),
                (Err(at), Some(member)) => {
                    set.list.insert(at, Arc::clone(member));
                    None
                }
                (Err(_), None) => None,
            };
            if let Some(gone) = gone {
                set.count(gone.workload.weight(), false);
            }
        }
        set.list.resize();
        set.sum();
        set
    }

    /// Counts one endpoint of `weight` in (`add`) or out.
    fn count(&mut self, weight: u32, add: bool) {
        let (sum, squares) = &mut self.moments;
        let (w, w2) = (u64::from(weight), u128::from(weight) * u128::from(weight));
        if add {
            *sum = sum.saturating_add(w);
            *squares = squares.saturating_add(w2);
        } else {
            *sum = sum.saturating_sub(w);
            *squares = squares.saturating_sub(w2);
        }
    }

    /// The running sums, when weights differ (the one case that reads
    /// every endpoint: weighted services are rare and small).
    fn sum(&mut self) {
        let (sum, squares) = self.moments;
        let n = self.list.len() as u128;
        // Exact while n * squares fits in 128 bits: any real service.
        let even = n.saturating_mul(squares) == u128::from(sum) * u128::from(sum);
        self.sums = (!even).then(|| {
            let mut sum = 0u64;
            self.list
                .rotated(0)
                .map(|w| {
                    sum += u64::from(w.workload.weight());
                    sum
                })
                .collect()
        });
    }

    /// The endpoints' running sum of weights, when they differ; `None`
    /// when every endpoint weighs the same (then the choice is even). All
    /// of weight 0 is taken as all equal (ztunnel's draw would find no
    /// endpoint; istiod never sends 0: an unset WorkloadEntry weight is no
    /// capacity).
    pub fn sums(&self) -> Option<&[u64]> {
        self.sums.as_deref()
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.list.len() == 0
    }

    /// Every endpoint, in entry order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<MeshWorkload>> {
        self.list.rotated(0)
    }

    /// Every endpoint, beginning at the `start`th (modulo their number)
    /// and wrapping around.
    pub fn rotated(&self, start: usize) -> impl Iterator<Item = &Arc<MeshWorkload>> {
        self.list
            .rotated(start.checked_rem(self.list.len()).unwrap_or(0))
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use std::sync::Arc;

    use super::EndpointSet;
    use crate::{
        config::{
            LocalConfig,
            entries::{EntryKey, Multi},
        },
        state::{MeshState, MeshWorkload, Values},
    };

    /// Workloads a0..a9 (a3 of capacity 3) from a config, each held under
    /// its file position.
    fn members() -> Vec<Arc<MeshWorkload>> {
        many(10)
    }

    /// Workloads a0..a(n-1), a3 of capacity 3.
    fn many(n: usize) -> Vec<Arc<MeshWorkload>> {
        let workloads: String = (0..n)
            .map(|i| {
                let capacity = if i == 3 { ", capacity: 3" } else { "" };
                format!(
                    "- {{uid: a{i}, name: a{i}, namespace: shop, workloadIps: [10.1.{}.{}]{capacity}}}\n",
                    i / 200,
                    10 + i % 200
                )
            })
            .collect();
        let config = LocalConfig::parse(&format!("workloads:\n{workloads}"), "t").unwrap();
        let state = MeshState::from_config(&config).unwrap();
        state.workloads.iter().cloned().collect()
    }

    /// `of` as a service's members.
    fn values(of: &[Arc<MeshWorkload>]) -> Values<Arc<MeshWorkload>> {
        let mut all = Multi::default();
        for w in of {
            all.insert("svc".to_owned(), w.key.clone(), Arc::clone(w));
        }
        all.all("svc").cloned().unwrap_or_default()
    }

    fn names(set: &EndpointSet) -> Vec<String> {
        set.iter().map(|w| w.workload.name.clone()).collect()
    }

    #[test]
    fn a_changed_set_is_the_set_built_from_its_members() {
        let all = members();
        let odd = |w: &MeshWorkload| {
            w.workload
                .name
                .trim_start_matches('a')
                .parse::<u32>()
                .unwrap()
                % 2
                == 1
        };
        // From the even ones, then the members change one at a time: a
        // member added, one removed, one that `odd` no longer keeps, one
        // touched twice, one touched but unchanged.
        let mut held: Vec<Arc<MeshWorkload>> = all.iter().step_by(2).cloned().collect();
        let mut set = EndpointSet::of(Some(&values(&held)), |_| true);
        let steps: [(&[usize], &[usize]); 4] =
            [(&[1, 9], &[]), (&[], &[4]), (&[5], &[0, 0]), (&[], &[2])];
        for (add, remove) in steps {
            held.extend(add.iter().map(|i| Arc::clone(&all[*i])));
            held.retain(|w| !remove.iter().any(|i| w.key == all[*i].key));
            held.sort_by(|a, b| a.key.cmp(&b.key));
            let touched: Vec<EntryKey> = add
                .iter()
                .chain(remove)
                .map(|i| all[*i].key.clone())
                .collect();
            let now = values(&held);
            let changed = set.changed(&touched, Some(&now), |_| true);
            assert_eq!(
                names(&changed),
                names(&EndpointSet::of(Some(&now), |_| true))
            );
            assert_eq!(changed.sums(), EndpointSet::of(Some(&now), |_| true).sums());
            // A filter decides for the touched members (the others were
            // kept by it before).
            let filtered = set.changed(&touched, Some(&now), odd);
            for key in &touched {
                let kept = filtered.iter().any(|w| w.key == *key);
                let expected = held.iter().any(|w| w.key == *key && odd(w));
                assert_eq!(kept, expected, "{key:?}");
            }
            set = changed;
        }
        assert_eq!(names(&set), ["a1", "a5", "a6", "a8", "a9"]);
        // Gone entirely: every touched member leaves.
        let keys: Vec<EntryKey> = held.iter().map(|w| w.key.clone()).collect();
        assert!(set.changed(&keys, None, |_| true).is_empty());
    }

    #[test]
    fn a_set_grown_past_a_chunk_and_shrunk_back_changes_as_a_small_one() {
        let all = many(150);
        // Members join one at a time from the ends inwards (so inserts go
        // to the middle), then leave every other one, each step checked
        // against the set built whole, and its rotation with it.
        let order: Vec<usize> = (0..75).flat_map(|i| [i, 149 - i]).collect();
        let mut held: Vec<Arc<MeshWorkload>> = Vec::new();
        let mut set = EndpointSet::default();
        let leaving: Vec<usize> = (0..150).step_by(2).chain((1..150).step_by(2)).collect();
        for (step, (i, joins)) in order
            .iter()
            .map(|i| (*i, true))
            .chain(leaving.iter().map(|i| (*i, false)).take(140))
            .enumerate()
        {
            if joins {
                held.push(Arc::clone(&all[i]));
            } else {
                held.retain(|w| w.key != all[i].key);
            }
            held.sort_by(|a, b| a.key.cmp(&b.key));
            let now = values(&held);
            set = set.changed(&[all[i].key.clone()], Some(&now), |_| true);
            let whole = EndpointSet::of(Some(&now), |_| true);
            assert_eq!(names(&set), names(&whole), "step {step}");
            assert_eq!(set.sums(), whole.sums(), "step {step}");
            let start = step * 7;
            let rotated =
                |s: &EndpointSet| s.rotated(start).map(|w| w.key.clone()).collect::<Vec<_>>();
            assert_eq!(rotated(&set), rotated(&whole), "step {step}");
            if step == 149 {
                assert!(matches!(set.list, super::List::Large(_)), "150 held");
            }
        }
        assert!(matches!(set.list, super::List::Small(_)), "10 held");
        assert_eq!(set.len(), 10);
    }

    #[test]
    fn weights_are_summed_only_while_they_differ() {
        let all = members();
        let set = EndpointSet::of(Some(&values(&all[..3])), |_| true);
        assert_eq!(set.sums(), None);
        // a3 weighs 3: the sums appear with it and go with it.
        let with = set.changed(&[all[3].key.clone()], Some(&values(&all[..4])), |_| true);
        assert_eq!(with.sums(), Some(&[1, 2, 3, 6][..]));
        let without = with.changed(&[all[3].key.clone()], Some(&values(&all[..3])), |_| true);
        assert_eq!(without.sums(), None);
    }

    #[test]
    fn rotation_begins_at_the_start_and_wraps() {
        let all = members();
        let set = EndpointSet::of(Some(&values(&all[..4])), |_| true);
        let from = |start| {
            set.rotated(start)
                .map(|w| w.workload.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(from(0), ["a0", "a1", "a2", "a3"]);
        assert_eq!(from(2), ["a2", "a3", "a0", "a1"]);
        assert_eq!(from(5), ["a1", "a2", "a3", "a0"]);
        assert_eq!(EndpointSet::default().rotated(3).count(), 0);
    }
}
