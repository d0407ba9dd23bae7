//! The state before the one in force, kept to make the next one from.
//!
//! A state made from the one in force shares every node of its indexes
//! with it, so a change copies each node on its paths, and each copy
//! touches what the node points at (up to 64 children or entries, each an
//! `Arc` whose count goes up): at 10,000 workloads a single-workload
//! change made that way cost about 960 us when the mesh was cold in the
//! caches (`benches/xds_update.rs` `idle`), against 390 us made in place.
//! Readers of the state in force keep it as it is, so the change cannot be
//! made to it; but the state it replaced is read by no one once the
//! connections that took it are done, and its nodes are shared with the
//! one in force only where no change since went. So the writer keeps that
//! one, with the change that separates it from the state in force: the
//! next change first brings it up to the state in force (taking the
//! entries built for that one, so both share them), then makes the new
//! change, both in place. Where a node is still shared, [`imbl`] copies it
//! as before; where a connection still holds the spare, the change is made
//! from the state in force as before: the result is the same either way,
//! only the cost differs.

use std::sync::{Arc, Weak};

use super::{Affected, MeshState, StateError};
use crate::config::changes::Changes;

/// The writer's spare state (see the module docs). Holds nothing until
/// the first change after a state built whole.
#[derive(Debug, Default)]
pub struct Spare {
    held: Option<Held>,
}

#[derive(Debug)]
struct Held {
    /// The state that `changes` bring up to `leads_to`.
    state: Arc<MeshState>,
    changes: Changes,
    /// The state in force once `changes` were made (weak: the spare
    /// does not keep it alive, only tells it from another).
    leads_to: Weak<MeshState>,
}

impl Spare {
    /// `current` (the state in force) with `changes` made, and what the
    /// change can have changed for a connection; made on the spare when it
    /// leads to `current`, else (or when making it there fails) from
    /// `current` as [`MeshState::apply_tracked`] does. The spare is used up
    /// either way: [`Self::keep`] gives the next one.
    pub fn next(
        &mut self,
        current: &Arc<MeshState>,
        changes: &Changes,
    ) -> Result<(Arc<MeshState>, Affected), StateError> {
        let held = self
            .held
            .take()
            .filter(|held| std::ptr::eq(held.leads_to.as_ptr(), Arc::as_ptr(current)));
        if let Some(Held {
            mut state,
            changes: pending,
            ..
        }) = held
        {
            // A connection still reading it: bringing it up to date
            // would copy as much as the change itself, for nothing.
            if let Some(spare) = Arc::get_mut(&mut state)
                && spare.apply_with(&pending, Some(current)).is_ok()
            {
                spare.provenance = current.provenance.clone();
                spare.origin.clone_from(&current.origin);
                if let Ok(affected) = spare.apply_in_place(changes) {
                    return Ok((state, affected));
                }
            }
        }
        current
            .apply_tracked(changes)
            .map(|(next, affected)| (Arc::new(next), affected))
    }

    /// `installed` is in force in place of `replaced`, `changes` apart:
    /// `replaced` is the next spare.
    pub fn keep(&mut self, replaced: Arc<MeshState>, changes: Changes, installed: &Arc<MeshState>) {
        self.held = Some(Held {
            state: replaced,
            changes,
            leads_to: Arc::downgrade(installed),
        });
    }

    /// Forgets the spare (the state in force was built whole).
    pub fn clear(&mut self) {
        self.held = None;
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use std::sync::Arc;

    use super::Spare;
    use crate::{
        config::{LocalConfig, changes::Changes, entries::EntryKey},
        state::MeshState,
    };

    const MESH: &str = r#"
workloads:
- {uid: a, name: a, namespace: shop, workloadIps: [10.1.0.10],
   services: {'shop/web.shop.svc.cluster.local': {80: 8080}}}
- {uid: b, name: b, namespace: shop, workloadIps: [10.1.0.11],
   services: {'shop/web.shop.svc.cluster.local': {80: 8080}}}
services:
- {name: web, namespace: shop, hostname: web.shop.svc.cluster.local, vips: ['/10.96.0.10'], ports: {80: 8080}}
"#;

    /// What a state serves: its entries, and each service's endpoints.
    fn served(state: &MeshState) -> (LocalConfig, Vec<Vec<String>>) {
        let endpoints = ["10.96.0.10", "10.96.0.11"]
            .into_iter()
            .map(|vip| {
                state
                    .services
                    .by_vip(vip.parse().unwrap())
                    .map(|s| {
                        s.endpoints()
                            .iter()
                            .map(|w| w.workload.uid.to_string())
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect();
        (state.config(), endpoints)
    }

    #[test]
    fn states_made_on_the_spare_are_the_ones_made_from_the_state_in_force() {
        let file = LocalConfig::parse(MESH, "t").unwrap();
        let workload = |i: usize, edit: &dyn Fn(&mut crate::config::Workload)| {
            let mut w = (*file.workloads[i]).clone();
            edit(&mut w);
            (EntryKey::file(i), Some(Arc::new(w)))
        };
        let mut moved_service = file.services[0].clone();
        moved_service.vips = vec!["10.96.0.11".parse().unwrap()];
        let steps = [
            Changes {
                workloads: vec![workload(0, &|w| w.service_account = "renamed".into())],
                ..Changes::default()
            },
            Changes {
                workloads: vec![workload(1, &|w| {
                    w.workload_ips = vec!["10.1.0.12".parse().unwrap()].into();
                })],
                ..Changes::default()
            },
            Changes {
                services: vec![(EntryKey::file(0), Some(Arc::new(moved_service)))],
                ..Changes::default()
            },
            Changes {
                workloads: vec![(EntryKey::file(0), None)],
                ..Changes::default()
            },
            Changes {
                workloads: vec![workload(0, &|w| w.services = Default::default())],
                ..Changes::default()
            },
        ];
        let mut reference = MeshState::from_config(&file).unwrap();
        let mut current = Arc::new(MeshState::from_config(&file).unwrap());
        let mut spare = Spare::default();
        let mut made_on_the_spare = 0;
        let mut shared_services = 0;
        for (step, changes) in steps.into_iter().enumerate() {
            let (expected, expected_affected) = reference.apply_tracked(&changes).unwrap();
            let spare_ptr = spare.held.as_ref().map(|held| Arc::as_ptr(&held.state));
            let (next, affected) = spare.next(&current, &changes).unwrap();
            assert_eq!(served(&next), served(&expected), "step {step}");
            assert_eq!(affected, expected_affected, "step {step}");
            if spare_ptr == Some(Arc::as_ptr(&next)) {
                made_on_the_spare += 1;
                // The replayed change took the entries built for the state
                // in force: the two share them.
                for w in current.workloads.iter() {
                    if changes.workloads.iter().any(|(key, _)| *key == w.key) {
                        continue;
                    }
                    let here = next.workloads.by_key(&w.key).unwrap();
                    assert!(Arc::ptr_eq(here, w), "step {step}: {:?}", w.key);
                }
                // So are the services this change did not build again.
                let named = |key: &str| {
                    changes.workloads.iter().any(|(entry, new)| {
                        let old = current.workloads.by_key(entry).map(|w| &w.workload);
                        old.into_iter()
                            .chain(new)
                            .any(|w| w.services.contains_key(key))
                    }) || !changes.services.is_empty()
                };
                for service in current.services.definitions() {
                    let key = service.key();
                    if !named(&key) {
                        let (here, there) =
                            (next.services.by_key(&key), current.services.by_key(&key));
                        assert!(
                            Arc::ptr_eq(here.unwrap(), there.unwrap()),
                            "step {step}: {key}"
                        );
                        shared_services += 1;
                    }
                }
            }
            let replaced = std::mem::replace(&mut current, next);
            spare.keep(replaced, changes, &current);
            reference = expected;
        }
        // Every change but the first (which has no spare yet).
        assert_eq!(made_on_the_spare, 4);
        assert_eq!(
            shared_services, 1,
            "the last change leaves the service alone"
        );

        // A reader still holding the spare: made from the state in force.
        let held = Arc::clone(&spare.held.as_ref().unwrap().state);
        let changes = Changes {
            workloads: vec![(EntryKey::file(1), None)],
            ..Changes::default()
        };
        let (next, _) = spare.next(&current, &changes).unwrap();
        assert!(!Arc::ptr_eq(&next, &held));
        assert_eq!(served(&next), served(&reference.apply(&changes).unwrap()));
    }
}
