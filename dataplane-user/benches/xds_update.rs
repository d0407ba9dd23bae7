//! What one single-workload xDS update costs the agent, stage by stage, at
//! the sizes of issue 31's synthetic meshes (N workloads with one IP, one
//! service per ten workloads, one namespace policy per hundred), held as
//! istiod sent them:
//!
//! - `apply/<N>`: the client applies the one-resource delta to what it
//!   holds while the published snapshot still shares it (as it does
//!   between two pushes);
//! - `translate/<N>`: istiod's resources into the mesh model, from
//!   nothing (the first push);
//! - `update/<N>`: the model brought up to a push that changed one
//!   workload (what every later push does);
//! - `build/<N>`: the file merged in (empty here) and the mesh state built
//!   whole (the first state);
//! - `whole/<N>`: apply, model update, merge and the next state made on
//!   the spare (`state::Spare`), in a row: what a push costs before the
//!   install re-checks connections;
//! - `spread/<N>`: `whole`, with each push changing another workload, as
//!   `dp-scale` churns the mesh;
//! - `idle/10000`: `spread` with 50 ms of idleness before each push (20
//!   updates a second), the gaps not timed: what a push costs the agent;
//! - `large/10000`: `idle` in a mesh of ten services of a thousand
//!   endpoints each (a large Deployment's): what a push costs when the
//!   workload it changes serves a large service.
//!
//! Alone: `cargo bench -p dataplane-user --bench xds_update`.

use std::{hint::black_box, sync::Arc, time::Duration};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dataplane_user::{
    config::LocalConfig,
    istio_api::ADDRESS_TYPE,
    sources::{FileIndex, merge_changes, merged_state},
    state::{MeshState, Spare},
    xds::{Response, XdsModel, XdsResources, translate},
};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::{held, response, workload};

fn stages(c: &mut Criterion) {
    let mut group = c.benchmark_group("xds_update");
    group.sample_size(10);
    let file = LocalConfig::default();
    for n in [1_000, 10_000] {
        let resources = Arc::new(held(n, (n / 10).max(1), (n / 100).max(1)));
        let services = (n / 10).max(1);
        let namespaces = (n / 100).max(1);
        // One workload relabelled, back and forth between two revisions of
        // workload n/2, so each push changes it.
        let updates = [
            response(
                ADDRESS_TYPE,
                vec![workload(n / 2, services, namespaces, "v2")],
            ),
            response(
                ADDRESS_TYPE,
                vec![workload(n / 2, services, namespaces, "v3")],
            ),
        ];
        let update = &updates[0];
        group.bench_with_input(BenchmarkId::new("apply", n), &resources, |b, held| {
            b.iter(|| {
                // The snapshot shares `held`: make_mut copies it first.
                let mut mine = Arc::clone(held);
                black_box(Arc::make_mut(&mut mine).apply(update))
            });
        });
        group.bench_with_input(BenchmarkId::new("translate", n), &resources, |b, held| {
            b.iter(|| black_box(translate(held, "xds://bench").config.workloads.len()));
        });
        group.bench_with_input(BenchmarkId::new("update", n), &resources, |b, held| {
            let mut model = XdsModel::default();
            model.update(held);
            let mut push = 0usize;
            b.iter(|| {
                push += 1;
                let mut mine = Arc::clone(held);
                Arc::make_mut(&mut mine).apply(&updates[push % 2]);
                black_box(model.update(&mine).workloads.len())
            });
        });
        let entries = XdsModel::default().update(&resources).clone();
        group.bench_with_input(BenchmarkId::new("build", n), &entries, |b, entries| {
            b.iter(|| {
                black_box(
                    merged_state(&file, Some(("xds://bench", entries))).map(|s| s.workloads.len()),
                )
            });
        });
        group.bench_with_input(BenchmarkId::new("whole", n), &resources, |b, held| {
            let Some(mut agent) = Agent::new(&file, held, n, services) else {
                return;
            };
            let mut push = 0usize;
            b.iter(|| {
                push += 1;
                // The published snapshot shares what istiod sent: the push
                // copies it first, as in the agent.
                agent.held = Arc::clone(held);
                black_box(agent.push(&updates[push % 2]))
            });
        });
        group.bench_with_input(BenchmarkId::new("spread", n), &resources, |b, held| {
            // As `whole`, but each push changes another workload (spread
            // over the mesh as `dp-scale` churns it), so no push finds the
            // paths the previous one copied.
            let Some(mut agent) = Agent::new(&file, held, n, services) else {
                return;
            };
            b.iter(|| black_box(agent.push_next()));
        });
        if n == 10_000 {
            idle(&mut group, "idle", n, services, &resources, &file);
            let large = Arc::new(held(n, 10, namespaces));
            idle(&mut group, "large", n, 10, &large, &file);
        }
    }
    group.finish();
}

/// What the agent holds between pushes (`sources::xds_changed`): what
/// istiod sent, the model made of it, the entries in force, the state
/// built from them and the spare the next is made on.
struct Agent {
    index: FileIndex,
    model: XdsModel,
    held: Arc<XdsResources>,
    state: Arc<MeshState>,
    spare: Spare,
    /// Workloads, services and namespaces of the synthetic mesh, and the
    /// pushes made by [`Agent::push_next`].
    sizes: (usize, usize, usize),
    pushes: usize,
}

impl Agent {
    /// The agent once `held`, the synthetic mesh of `n` workloads serving
    /// `services` services, is in force.
    fn new(
        file: &LocalConfig,
        held: &Arc<XdsResources>,
        n: usize,
        services: usize,
    ) -> Option<Self> {
        let mut model = XdsModel::default();
        let state = merged_state(file, Some(("xds://bench", model.update(held)))).ok()?;
        model.taken_in();
        Some(Self {
            index: FileIndex::of(file),
            model,
            held: Arc::clone(held),
            state: Arc::new(state),
            spare: Spare::default(),
            sizes: (n, services, (n / 100).max(1)),
            pushes: 0,
        })
    }

    /// Applies `update` as the agent does: to what istiod sent, then the
    /// model, the merge with the file and the next state made on the spare
    /// (the state the one in force replaced, which then becomes the spare).
    /// Returns the workload count.
    fn push(&mut self, update: &Response) -> usize {
        Arc::make_mut(&mut self.held).apply(update);
        self.model.update(&self.held);
        let mut provenance = self.state.provenance.clone();
        let changes = merge_changes(
            &self.index,
            self.model.entries(),
            self.model.pending(),
            &mut provenance,
        );
        if let Ok((mut next, _)) = self.spare.next(&self.state, &changes) {
            Arc::make_mut(&mut next).provenance = provenance;
            let replaced = std::mem::replace(&mut self.state, next);
            self.spare.keep(replaced, changes, &self.state);
            self.model.taken_in();
        }
        self.state.workloads.len()
    }

    /// A push relabelling the next workload of a walk over the whole mesh.
    fn push_next(&mut self) -> usize {
        self.pushes += 1;
        let (n, services, namespaces) = self.sizes;
        let i = (self.pushes * 7919) % n;
        let update = response(
            ADDRESS_TYPE,
            vec![workload(
                i,
                services,
                namespaces,
                &format!("p{}", self.pushes),
            )],
        );
        self.push(&update)
    }
}

/// `spread`, with the 50 ms between pushes that 20 updates a second leave
/// (`dp-scale`'s churn), timed without the gaps. Idle, the caches and
/// TLBs lose the mesh's nodes to everything else on the machine; a push
/// then costs what it touches cold (on the 2-core VM it was 65 us back to
/// back and 4 ms after a 50 ms gap, and spinning the CPU before a push did
/// not bring it back): the figure to compare with ztunnel's CPU per
/// update, and the one that counts cache lines touched, not instructions.
fn idle(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    n: usize,
    services: usize,
    resources: &Arc<XdsResources>,
    file: &LocalConfig,
) {
    let Some(mut agent) = Agent::new(file, resources, n, services) else {
        return;
    };
    group.bench_function(BenchmarkId::new(name, n), |b| {
        b.iter_custom(|iters| {
            let mut busy = Duration::ZERO;
            for _ in 0..iters {
                std::thread::sleep(Duration::from_millis(50));
                let started = std::time::Instant::now();
                black_box(agent.push_next());
                busy += started.elapsed();
            }
            busy
        });
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = stages
}
criterion_main!(benches);
