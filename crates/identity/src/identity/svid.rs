//! What one `FetchX509SVID` message holds, bounded and checked: the SVIDs
//! by SPIFFE ID, each with its chain, key and trust-domain bundle, and the
//! federated bundles.
//!
//! The message is taken apart when it arrives (sizes and counts bounded,
//! DER split into certificates) but an SVID is checked against the identity
//! only when the store asks for it ([`RawSvid::check`]): a SPIRE agent may
//! hand the node agent SVIDs it never uses (its own, non-Istio IDs), and
//! one such SVID must not make the others unusable.
//!
//! Field meanings are the SPIFFE Workload API's (spiffe/spiffe
//! `standards/SPIFFE_Workload_API.md`, section "X.509-SVID Profile";
//! go-spiffe `proto/spiffe/workload/workload.proto`, `X509SVID`): chains
//! and bundles are concatenated DER certificates, the leaf first; the key
//! is unencrypted PKCS#8 DER.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash as _, Hasher as _};
use std::sync::Arc;

use dataplane_istio_api::spiffe_workload::X509svidResponse;
use rcgen::{KeyPair, PublicKeyData as _};
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use x509_parser::prelude::{FromDer, X509Certificate};

use super::bundle::MAX_ROOTS;
use super::istio_ca::{IstioIssued, checked_chain};
use super::spiffe::Identity;

/// Most SVIDs taken from one message (a node agent's entitlements).
pub const MAX_SVIDS: usize = 4096;
/// Most certificates in one SVID's chain.
const MAX_CHAIN: usize = 16;
/// Most federated trust domains taken from one message.
const MAX_FEDERATED: usize = 256;

/// One SVID as the server sent it, split into certificates.
#[derive(Debug)]
pub struct RawSvid {
    /// The leaf, then intermediates.
    chain: Vec<CertificateDer<'static>>,
    /// PKCS#8 DER.
    key: Vec<u8>,
    /// The roots of the SVID's trust domain.
    bundle: Vec<CertificateDer<'static>>,
    /// A digest of what was sent, so an unchanged SVID is not checked again.
    pub fingerprint: u64,
}

/// One message of the stream.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// By SPIFFE ID (`spiffe://td/...`), any shape.
    pub svids: HashMap<String, Arc<RawSvid>>,
    /// Federated trust domains and how many roots each sent.
    pub federated: BTreeMap<String, usize>,
}

impl Snapshot {
    /// Takes a message apart; the reason when it breaks a bound or is not
    /// DER certificates. A message with no SVID is refused: SPIRE never
    /// sends one (it ends the stream with `PermissionDenied` instead,
    /// `pkg/agent/endpoints/workload/handler.go` `sendX509SVIDResponse`).
    pub fn from_message(message: X509svidResponse) -> Result<Self, String> {
        if message.svids.is_empty() {
            return Err("the message holds no SVID".into());
        }
        if message.svids.len() > MAX_SVIDS {
            return Err(format!(
                "{} SVIDs, more than {MAX_SVIDS}",
                message.svids.len()
            ));
        }
        if message.federated_bundles.len() > MAX_FEDERATED {
            return Err(format!(
                "{} federated bundles, more than {MAX_FEDERATED}",
                message.federated_bundles.len()
            ));
        }
        let mut svids = HashMap::with_capacity(message.svids.len());
        for svid in message.svids {
            let what = |part: &str| format!("{part} of {}", clip(&svid.spiffe_id));
            let chain = split_der(&svid.x509_svid, MAX_CHAIN)
                .map_err(|e| format!("{}: {e}", what("the certificate chain (x509_svid)")))?;
            let bundle = split_der(&svid.bundle, MAX_ROOTS)
                .map_err(|e| format!("{}: {e}", what("the bundle")))?;
            let mut hasher = DefaultHasher::new();
            svid.x509_svid.hash(&mut hasher);
            svid.x509_svid_key.hash(&mut hasher);
            svid.bundle.hash(&mut hasher);
            let raw = RawSvid {
                chain,
                key: svid.x509_svid_key,
                bundle,
                fingerprint: hasher.finish(),
            };
            // The specification leaves duplicates open; SPIRE sends the
            // oldest entry's first (`handler.go` `FetchX509SVID`, its
            // comment on hints), so the first one wins.
            svids.entry(svid.spiffe_id).or_insert_with(|| Arc::new(raw));
        }
        let mut federated = BTreeMap::new();
        for (domain, der) in message.federated_bundles {
            let roots = split_der(&der, MAX_ROOTS)
                .map_err(|e| format!("the federated bundle of {}: {e}", clip(&domain)))?;
            federated.insert(domain, roots.len());
        }
        Ok(Self { svids, federated })
    }

    /// The SPIFFE IDs offered, sorted, at most `n` of them.
    pub fn offered(&self, n: usize) -> Vec<String> {
        let mut ids: Vec<String> = self.svids.keys().map(|id| clip(id)).collect();
        ids.sort();
        ids.truncate(n);
        ids
    }
}

impl RawSvid {
    /// The roots of the SVID's trust domain, as sent.
    pub fn bundle(&self) -> &[CertificateDer<'static>] {
        &self.bundle
    }

    /// Checks the SVID for `identity`: the key is PKCS#8, the leaf names
    /// exactly `identity` and carries that key, and the chain verifies to
    /// the bundle sent with it (the same checks as a certificate from
    /// Istio's CA, [`checked_chain`]). The roots returned are the bundle.
    pub fn check(&self, identity: &Identity) -> Result<IstioIssued, String> {
        let key = PrivatePkcs8KeyDer::from(self.key.clone());
        let pair = KeyPair::try_from(&key)
            .map_err(|e| format!("the key (x509_svid_key) is not a usable PKCS#8 key: {e}"))?;
        let pem = |certs: &[CertificateDer<'static>]| {
            certs
                .iter()
                .map(|c| pem::encode(&pem::Pem::new("CERTIFICATE", c.to_vec())))
                .collect::<String>()
        };
        if self.bundle.is_empty() {
            return Err("the bundle is empty".into());
        }
        let elements = [pem(&self.chain), pem(&self.bundle)];
        checked_chain(&elements, identity, &pair.subject_public_key_info(), key)
    }
}

/// Splits concatenated DER certificates; at most `max`, at least one.
fn split_der(mut der: &[u8], max: usize) -> Result<Vec<CertificateDer<'static>>, String> {
    let mut certs = Vec::new();
    while !der.is_empty() {
        if certs.len() == max {
            return Err(format!("more than {max} certificates"));
        }
        let (rest, _) = X509Certificate::from_der(der)
            .map_err(|e| format!("certificate {} is not DER: {e}", certs.len()))?;
        let used = der.len() - rest.len();
        certs.push(CertificateDer::from(der[..used].to_vec()));
        der = rest;
    }
    if certs.is_empty() {
        return Err("no certificate".into());
    }
    Ok(certs)
}

/// A SPIFFE ID from the server, cut for messages (it is unchecked input).
fn clip(id: &str) -> String {
    const MAX: usize = 256;
    match id.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}...", &id[..at]),
        None => id.to_owned(),
    }
}
