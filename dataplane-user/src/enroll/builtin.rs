//! Pods served by this agent's own engine: each gets its certificate, its
//! in-pod listeners and an engine serving them before the kernel programs
//! are pointed at the listeners.

use std::sync::Arc;

use super::{
    EnrollError, PodSpec,
    pods::{Enrollments, Prepared},
    serving::{BuiltinPod, Serving},
};
use crate::{
    dns::PodDns,
    hbone::HbonePool,
    proxy::{
        PodContext, PodEngine, PodIdentity, PodListeners, PodNetns, PodTlsDialer,
        original_source::PodOriginalSource,
    },
    redirect::OrigDstTable,
    tls,
};

impl Enrollments {
    /// Issues the pod's certificate and starts its engine on `listeners`.
    pub(super) fn prepare(
        &self,
        spec: &PodSpec,
        netns: PodNetns,
        cookie: u64,
        listeners: PodListeners,
    ) -> Result<Prepared, EnrollError> {
        let identity_err =
            |source: Box<dyn std::error::Error + Send + Sync>| EnrollError::Identity {
                uid: spec.uid.clone(),
                source,
            };
        let spiffe = spec.identity().map_err(|e| identity_err(Box::new(e)))?;
        let mesh = Arc::clone(&self.settings.mesh);
        // The built-in CA issues now; a remote source is asked by the
        // certificate store's task (readiness waits for it), so a CA that
        // is down or slow never holds the enrollment actor.
        mesh.certs
            .want(&spiffe)
            .map_err(|e| identity_err(Box::new(e)))?;
        let server_tls = tls::server_config(
            mesh.certs.resolver(spiffe.clone()),
            Arc::clone(&mesh.roots),
            &mesh.trust_domain,
        )
        .map_err(|e| identity_err(Box::new(e)))?;
        let table = match self.redirector {
            Some(_) => Some(OrigDstTable::open(&self.pins, cookie)?),
            None => None,
        };
        let original = PodOriginalSource::set_up(self.settings.original_source.as_ref(), &netns)
            .map_err(|source| EnrollError::OriginalSource {
                uid: spec.uid.clone(),
                source,
            })?;
        let pool = HbonePool::with_settings(
            PodTlsDialer {
                netns: netns.clone(),
                mark: self.settings.proxy_mark,
                mesh: Arc::clone(&mesh),
            },
            mesh.pool_idle_timeout,
            mesh.pool_spread,
            mesh.h2,
        );
        let ctx = Arc::new(PodContext {
            identity: PodIdentity {
                uid: spec.uid.clone(),
                name: spec.name.clone(),
                namespace: spec.namespace.clone(),
            },
            peer: Arc::new(crate::telemetry::Peer {
                workload: Some(spec.name.as_str().into()),
                namespace: Some(spec.namespace.as_str().into()),
                principal: Some(spiffe.as_uri().into()),
                ..Default::default()
            }),
            spiffe: spiffe.clone(),
            ips: spec.ips.clone(),
            fast_path: spec.fast_path,
            netns: netns.clone(),
            netns_cookie: cookie,
            mark: self.settings.proxy_mark,
            original_source: original.transparent(self.redirector.as_ref().map(|_| &self.pins))?,
            mesh,
            pool,
            server_tls,
            baggage: Default::default(),
            stopping: tokio::sync::watch::Sender::new(false),
        });
        if let Some(fast_path) = ctx.mesh.fast_path.get() {
            fast_path.register(&ctx);
        }
        let served = listeners.try_clone().map_err(|source| EnrollError::Serve {
            uid: spec.uid.clone(),
            source,
        })?;
        let placement = self.settings.workers.place();
        let engine = PodEngine::start(ctx, served, table, placement).map_err(|source| {
            EnrollError::Serve {
                uid: spec.uid.clone(),
                source,
            }
        })?;
        let dns = PodDns::for_pod(
            self.settings.dns.as_ref(),
            spec.dns_capture,
            &netns,
            (&spec.name, &spec.namespace),
        );
        Ok(Prepared {
            cookie,
            netns,
            serving: Serving::Builtin(BuiltinPod {
                identity: spiffe,
                listeners,
                engine,
                retired: Vec::new(),
            }),
            dns,
            original,
        })
    }
}
