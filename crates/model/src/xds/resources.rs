//! The resources held from istiod, per type, and how one delta response
//! changes them: each resource is decoded and checked on its own, the
//! valid ones apply, an invalid one keeps whatever was held under its name
//! and is named in the NACK. A response therefore never replaces good
//! state with bad, and never holds back the good part of a push.
//!
//! What is held lives in persistent maps ([`imbl::OrdMap`]) of shared
//! entries: the client publishes a snapshot after every response and goes
//! on changing its own copy, and a copy shares every node the change does
//! not touch, so a response costs what it names, not what is held (at
//! 10k workloads a copied `BTreeMap` cost 18.8 ms per update).
//!
//! Each resource is held as the mesh model has it, translated once when
//! it arrives ([`IntoModel`]), with istiod's version and a digest of its
//! encoding (what tells a changed resource from one sent again): the
//! model's entries share the translation, so a workload is held once. Its
//! encoding, held before for the model to decode again, took about 245
//! bytes a workload besides (`benches/mesh_memory.rs`), and a decoded one
//! about 1.3 KB (prost's strings, vectors and its services `HashMap`).

use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use super::journal::{Journal, Kind, Named, Touched};
use super::translate::IntoModel;
use super::wire::Response;
use crate::config::interned::Strings;
use crate::istio_api::{
    ADDRESS_TYPE, AUTHORIZATION_TYPE,
    security::{self, Authorization},
    workload::{
        Address, GatewayAddress, Service, Workload, address, application_tunnel, gateway_address,
    },
};

/// Longest NACK message sent (the reasons of the first rejects).
const MAX_NACK_MESSAGE: usize = 4096;

/// One held resource, as the mesh model has it, and the version istiod
/// gave it.
pub struct Versioned<T: IntoModel> {
    /// istiod's version string (echoed back on reconnect).
    pub version: Box<str>,
    /// A digest of istiod's encoding: equal resources have equal ones.
    digest: u64,
    model: T::Model,
}

impl<T: IntoModel> Versioned<T> {
    /// `resource` at `version`, translated on its own (its strings not
    /// shared with other resources': for tests and tools).
    pub fn new(name: &Arc<str>, version: impl Into<Box<str>>, resource: &T) -> Self {
        let encoded = resource.encode_to_vec();
        Self::translated(
            name,
            version.into(),
            &encoded,
            resource,
            &mut Strings::default(),
        )
    }

    fn translated(
        name: &Arc<str>,
        version: Box<str>,
        encoded: &[u8],
        resource: &T,
        strings: &mut Strings,
    ) -> Self {
        Self {
            version,
            digest: digest(encoded),
            model: resource.to_model(name, strings),
        }
    }

    /// The resource in the mesh model.
    pub fn model(&self) -> &T::Model {
        &self.model
    }
}

/// A digest of a resource's encoding. Fixed-seeded: equal encodings in
/// any two holders have equal digests.
fn digest(encoded: &[u8]) -> u64 {
    foldhash::quality::FixedState::with_seed(0x5eed).hash_one(encoded)
}

impl<T: IntoModel> Clone for Versioned<T> {
    fn clone(&self) -> Self {
        Self {
            version: self.version.clone(),
            digest: self.digest,
            model: self.model.clone(),
        }
    }
}

impl<T: IntoModel> PartialEq for Versioned<T> {
    fn eq(&self, other: &Self) -> bool {
        self.version == other.version && self.digest == other.digest
    }
}

/// An equivalence, so that comparing two `Arc`s of one first compares
/// the pointers (the held maps' diffs compare every value of a leaf a
/// change went through, nearly all shared).
impl<T: IntoModel> Eq for Versioned<T> {}

impl<T: IntoModel> std::fmt::Debug for Versioned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Versioned")
            .field("version", &self.version)
            .field("digest", &self.digest)
            .finish()
    }
}

/// Resources of one type by name, each shared between the copies that
/// hold it. The name is held once: the mesh model's tables, the state's
/// keys and the claims share it.
pub type Held<T> = imbl::OrdMap<Arc<str>, Arc<Versioned<T>>>;

/// Everything held from istiod.
#[derive(Debug, Clone, Default)]
pub struct XdsResources {
    /// Workloads and services, by resource name (a workload's uid, a
    /// service's `namespace/hostname`).
    pub addresses: Held<Address>,
    /// Authorization policies, by `namespace/name`.
    pub authorizations: Held<Authorization>,
    /// The strings the translations share, shared by every copy (only
    /// the copy responses are applied to adds to them).
    strings: Arc<Mutex<Strings>>,
    /// The names the last responses touched.
    journal: Journal,
}

impl PartialEq for XdsResources {
    fn eq(&self, other: &Self) -> bool {
        self.addresses == other.addresses && self.authorizations == other.authorizations
    }
}

/// What to answer a response with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every resource applied.
    Ack,
    /// Some did not; the message names each (bounded).
    Nack(String),
}

impl XdsResources {
    /// The names and versions held of `type_url`, for a reconnect's
    /// `initial_resource_versions`.
    pub fn versions(&self, type_url: &str) -> BTreeMap<String, String> {
        fn of<T: IntoModel>(map: &Held<T>) -> BTreeMap<String, String> {
            map.iter()
                .map(|(name, held)| (name.to_string(), held.version.to_string()))
                .collect()
        }
        match type_url {
            ADDRESS_TYPE => of(&self.addresses),
            AUTHORIZATION_TYPE => of(&self.authorizations),
            _ => BTreeMap::new(),
        }
    }

    /// How many resources of `type_url` are held.
    pub fn held(&self, type_url: &str) -> usize {
        match type_url {
            ADDRESS_TYPE => self.addresses.len(),
            AUTHORIZATION_TYPE => self.authorizations.len(),
            _ => 0,
        }
    }

    /// The names that may differ between `earlier` and this copy (every
    /// name that does is among them), when known: `earlier` is this
    /// copy as it stood a few responses ago (at most
    /// [`journal::MAX_NAMES`](super::journal::MAX_NAMES) names back) and
    /// neither copy's maps were changed but by [`Self::apply`].
    pub fn touched_since(&self, earlier: &XdsResources) -> Option<Touched> {
        self.journal.touched_since(
            (&self.addresses, &self.authorizations),
            &earlier.journal,
            (&earlier.addresses, &earlier.authorizations),
        )
    }

    /// Applies one delta response; says whether to ACK or NACK it.
    pub fn apply(&mut self, response: &Response) -> Verdict {
        let strings = Arc::clone(&self.strings);
        let mut strings = strings.lock().unwrap_or_else(PoisonError::into_inner);
        self.journal.begin(&self.addresses, &self.authorizations);
        let mut named = Named::default();
        let (kind, rejects) = match response.type_url() {
            ADDRESS_TYPE => (
                Kind::Addresses,
                apply_to(
                    &mut self.addresses,
                    response,
                    check_address,
                    &mut strings,
                    &mut named,
                ),
            ),
            AUTHORIZATION_TYPE => (
                Kind::Authorizations,
                apply_to(
                    &mut self.authorizations,
                    response,
                    check_authorization,
                    &mut strings,
                    &mut named,
                ),
            ),
            other => (
                Kind::Addresses,
                vec![format!("resource type {other} was not asked for")],
            ),
        };
        self.journal
            .record(kind, named, &self.addresses, &self.authorizations);
        if rejects.is_empty() {
            return Verdict::Ack;
        }
        let mut message = format!("{} resource(s) rejected: ", rejects.len());
        for (i, reject) in rejects.iter().enumerate() {
            if message.len() + reject.len() + 2 > MAX_NACK_MESSAGE {
                message.push_str(&format!("; and {} more", rejects.len() - i));
                break;
            }
            if i > 0 {
                message.push_str("; ");
            }
            message.push_str(reject);
        }
        Verdict::Nack(message)
    }
}

/// Applies a response's resources and removals to `held`; returns the
/// rejects, each `name: reason`.
fn apply_to<T: IntoModel>(
    held: &mut Held<T>,
    response: &Response,
    check: fn(&T) -> Result<(), String>,
    strings: &mut Strings,
    named: &mut Named,
) -> Vec<String> {
    let mut rejects = Vec::new();
    for resource in response.resources() {
        let name = resource.name;
        let body = match resource.body {
            None => Err("no resource body".to_owned()),
            Some(any) if any.type_url != response.type_url() => Err(format!(
                "body is a {}, the response is of {}",
                any.type_url,
                response.type_url()
            )),
            Some(any) => Ok(any.value),
        };
        let checked = body.and_then(|body| {
            if name.is_empty() {
                return Err("resource without a name".to_owned());
            }
            let value =
                T::decode(body).map_err(|err| format!("not a valid protobuf message: {err}"))?;
            check(&value).map(|()| (body, value))
        });
        match checked {
            Ok((body, value)) => {
                let version = resource.version.into();
                let name = Arc::from(name);
                let translated = Versioned::translated(&name, version, body, &value, strings);
                named.push(&name);
                held.insert(name, Arc::new(translated));
            }
            Err(reason) => rejects.push(format!("{}: {reason}", printable(name))),
        }
    }
    for name in response.removed() {
        if let Some((name, _)) = held.remove_with_key(name) {
            named.push(&name);
        }
    }
    rejects
}

/// A name fit for a log line or a NACK: at most 200 characters.
fn printable(name: &str) -> String {
    if name.is_empty() {
        return "<unnamed>".to_owned();
    }
    name.chars().take(200).collect()
}

/// An IP from the 4 or 16 bytes Istio sends.
pub fn ip_from_bytes(bytes: &[u8]) -> Result<IpAddr, String> {
    match bytes.len() {
        4 => {
            let octets: [u8; 4] = bytes.try_into().map_err(|_| "bad IPv4 address")?;
            Ok(IpAddr::from(octets))
        }
        16 => {
            let octets: [u8; 16] = bytes.try_into().map_err(|_| "bad IPv6 address")?;
            Ok(IpAddr::from(octets))
        }
        n => Err(format!("an address of {n} bytes (expected 4 or 16)")),
    }
}

fn port(value: u32, what: &str) -> Result<u16, String> {
    u16::try_from(value).map_err(|_| format!("{what} {value} is not a port"))
}

fn check_address(address: &Address) -> Result<(), String> {
    match &address.r#type {
        Some(address::Type::Workload(workload)) => check_workload(workload),
        Some(address::Type::Service(service)) => check_service(service),
        None => Err("an address that is neither a workload nor a service".to_owned()),
    }
}

fn check_workload(workload: &Workload) -> Result<(), String> {
    if workload.uid.is_empty() {
        return Err("workload without uid".to_owned());
    }
    if workload.namespace.is_empty() || workload.name.is_empty() {
        return Err("workload without name or namespace".to_owned());
    }
    let or_default =
        |value: &str, default| if value.is_empty() { default } else { value }.to_owned();
    crate::identity::Identity::new(
        or_default(&workload.trust_domain, "cluster.local"),
        &workload.namespace,
        or_default(&workload.service_account, "default"),
    )
    .map_err(|err| format!("no valid identity: {err}"))?;
    for address in &workload.addresses {
        ip_from_bytes(address)?;
    }
    for (service, ports) in &workload.services {
        if !service.contains('/') {
            return Err(format!("service key `{service}` is not namespace/hostname"));
        }
        for p in &ports.ports {
            port(p.service_port, "service port")?;
            port(p.target_port, "target port")?;
        }
    }
    if let Some(tunnel) = &workload.application_tunnel {
        // ztunnel refuses an unknown protocol (`ApplicationTunnel::try_from`,
        // `src/state/workload.rs`) and truncates the port to 16 bits; a
        // port that does not fit is refused here instead of landing on
        // another one.
        application_tunnel::Protocol::try_from(tunnel.protocol)
            .map_err(|_| format!("unknown application tunnel protocol {}", tunnel.protocol))?;
        port(tunnel.port, "application tunnel port")?;
    }
    check_gateway(workload.waypoint.as_ref())?;
    check_gateway(workload.network_gateway.as_ref())
}

fn check_service(service: &Service) -> Result<(), String> {
    if service.hostname.is_empty() || service.namespace.is_empty() {
        return Err("service without hostname or namespace".to_owned());
    }
    for vip in &service.addresses {
        let ip = ip_from_bytes(&vip.address)?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if let Some(length) = vip.length.filter(|l| *l > max) {
            return Err(format!(
                "address {ip}/{length}: prefix longer than the address"
            ));
        }
    }
    for p in &service.ports {
        port(p.service_port, "service port")?;
        port(p.target_port, "target port")?;
    }
    for weighted in &service.weighted_waypoints {
        check_gateway(weighted.destination.as_ref())?;
    }
    check_gateway(service.waypoint.as_ref())
}

fn check_gateway(gateway: Option<&GatewayAddress>) -> Result<(), String> {
    let Some(gateway) = gateway else {
        return Ok(());
    };
    port(gateway.hbone_mtls_port, "waypoint HBONE port")?;
    match &gateway.destination {
        Some(gateway_address::Destination::Address(address)) => {
            ip_from_bytes(&address.address).map(drop)
        }
        Some(gateway_address::Destination::Hostname(host)) if host.hostname.is_empty() => {
            Err("waypoint hostname is empty".to_owned())
        }
        Some(gateway_address::Destination::Hostname(_)) => Ok(()),
        None => Err("waypoint without destination".to_owned()),
    }
}

fn check_authorization(policy: &Authorization) -> Result<(), String> {
    if policy.name.is_empty() || policy.namespace.is_empty() {
        return Err("authorization without name or namespace".to_owned());
    }
    security::Scope::try_from(policy.scope)
        .map_err(|_| format!("unknown scope {}", policy.scope))?;
    security::Action::try_from(policy.action)
        .map_err(|_| format!("unknown action {}", policy.action))?;
    let matches = policy
        .rules
        .iter()
        .flat_map(|rule| &rule.clauses)
        .flat_map(|clause| &clause.matches);
    for m in matches {
        let cidrs = m
            .source_ips
            .iter()
            .chain(&m.not_source_ips)
            .chain(&m.destination_ips)
            .chain(&m.not_destination_ips);
        for cidr in cidrs {
            let ip = ip_from_bytes(&cidr.address)?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            if cidr.length > max {
                return Err(format!("prefix length {} for {ip}", cidr.length));
            }
        }
        let strings = m
            .namespaces
            .iter()
            .chain(&m.not_namespaces)
            .chain(&m.principals)
            .chain(&m.not_principals);
        for string in strings {
            if string.match_type.is_none() {
                return Err("a string match without exact, prefix, suffix or presence".to_owned());
            }
        }
        for p in m.destination_ports.iter().chain(&m.not_destination_ports) {
            port(*p, "destination port")?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "resources_tests.rs"]
mod tests;
