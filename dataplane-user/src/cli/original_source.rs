//! Flags of the original-source feature: the engine connects to apps from
//! their clients' own addresses (see `proxy::original_source`).

use clap::{Args, ValueEnum};

use crate::proxy::original_source::{OriginalSource, SourceRouting};

/// When the engine connects to apps from the client's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OriginalSourceMode {
    /// Wherever the kernel allows (sk_lookup's ingress device, 5.17) and
    /// the pod's routing could be installed; elsewhere the pod's own
    /// address, shown per pod in `status`.
    Auto,
    /// Always; the agent refuses to start on a kernel without it, and a pod
    /// whose routing cannot be installed is not enrolled.
    On,
    /// Never: apps see the pod's own address (environments that forbid
    /// IP_TRANSPARENT or in-pod policy routing).
    Off,
}

/// Original-source settings.
#[derive(Debug, Clone, Args)]
pub struct OriginalSourceArgs {
    /// Connect to apps from their clients' own addresses (plaintext
    /// inbound and HBONE), as Istio's node proxy does.
    #[arg(
        long,
        env = "DATAPLANE_ORIGINAL_SOURCE",
        value_enum,
        default_value = "auto"
    )]
    pub original_source: OriginalSourceMode,
    /// Socket mark of the engine's connections to apps from a client's
    /// address; in-pod routing sends replies carrying it back to the
    /// engine. Must differ from the proxy mark and from 0.
    #[arg(long, env = "DATAPLANE_TRANSPARENT_MARK", default_value_t = dataplane_common::DEFAULT_TRANSPARENT_MARK, value_parser = super::parse_u32)]
    pub transparent_mark: u32,
    /// Routing table, inside each pod, of the `local` default routes that
    /// bring those replies back.
    #[arg(long, env = "DATAPLANE_ORIGINAL_SOURCE_TABLE", default_value_t = DEFAULT_TABLE, value_parser = clap::value_parser!(u32).range(1..=0xffff_fff0))]
    pub original_source_table: u32,
}

/// Default in-pod routing table: the default transparent mark's number.
pub const DEFAULT_TABLE: u32 = dataplane_common::DEFAULT_TRANSPARENT_MARK;

/// Priority of the in-pod rules: before the main table's (32766).
pub const RULE_PRIORITY: u32 = 32764;

/// Errors of the original-source flags.
#[derive(Debug, thiserror::Error)]
pub enum OriginalSourceArgsError {
    /// The transparent mark would be confused with another.
    #[error(
        "--transparent-mark {mark:#x} must be non-zero and differ from --proxy-mark {proxy_mark:#x} \
         (in-pod routing would catch the engine's own connections); pick another mark"
    )]
    Mark {
        /// The transparent mark given.
        mark: u32,
        /// The proxy mark.
        proxy_mark: u32,
    },
    /// `--original-source on` where it cannot work.
    #[error("--original-source on: {reason}; use --original-source auto or off")]
    Unsupported {
        /// Why it cannot work here.
        reason: &'static str,
    },
}

impl OriginalSourceArgs {
    /// The mark the kernel programs exempt: 0 when the feature is off.
    pub fn kernel_mark(&self, proxy_mark: u32) -> Result<u32, OriginalSourceArgsError> {
        if self.original_source == OriginalSourceMode::Off {
            return Ok(0);
        }
        if self.transparent_mark == 0 || self.transparent_mark == proxy_mark {
            return Err(OriginalSourceArgsError::Mark {
                mark: self.transparent_mark,
                proxy_mark,
            });
        }
        Ok(self.transparent_mark)
    }

    /// What the engine does, given whether this agent can do it at all
    /// (`Err` names why not: iptables capture, an old kernel).
    pub fn decide(
        &self,
        possible: Result<(), &'static str>,
    ) -> Result<Option<OriginalSource>, OriginalSourceArgsError> {
        let required = match self.original_source {
            OriginalSourceMode::Off => return Ok(None),
            OriginalSourceMode::Auto => false,
            OriginalSourceMode::On => true,
        };
        match possible {
            Ok(()) => Ok(Some(OriginalSource {
                routing: SourceRouting {
                    mark: self.transparent_mark,
                    table: self.original_source_table,
                    priority: RULE_PRIORITY,
                },
                required,
            })),
            Err(reason) if required => Err(OriginalSourceArgsError::Unsupported { reason }),
            Err(reason) => {
                tracing::info!(
                    reason,
                    "original source off: apps see the pod's own address as their clients'"
                );
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(mode: OriginalSourceMode, mark: u32) -> OriginalSourceArgs {
        OriginalSourceArgs {
            original_source: mode,
            transparent_mark: mark,
            original_source_table: DEFAULT_TABLE,
        }
    }

    #[test]
    fn the_transparent_mark_must_differ_from_the_proxy_mark() {
        let proxy = dataplane_common::DEFAULT_PROXY_MARK;
        assert!(matches!(
            args(OriginalSourceMode::Auto, proxy).kernel_mark(proxy),
            Err(OriginalSourceArgsError::Mark { .. })
        ));
        assert!(args(OriginalSourceMode::On, 0).kernel_mark(proxy).is_err());
        // Off exempts no second mark, whatever the flag says.
        assert_eq!(
            args(OriginalSourceMode::Off, proxy).kernel_mark(proxy).ok(),
            Some(0)
        );
        assert_eq!(
            args(OriginalSourceMode::Auto, 0x53a)
                .kernel_mark(proxy)
                .ok(),
            Some(0x53a)
        );
    }

    #[test]
    fn on_refuses_where_auto_turns_itself_off() {
        let old_kernel = Err("kernel before 5.17");
        assert!(matches!(
            args(OriginalSourceMode::On, 0x53a).decide(old_kernel),
            Err(OriginalSourceArgsError::Unsupported { .. })
        ));
        assert_eq!(
            args(OriginalSourceMode::Auto, 0x53a)
                .decide(old_kernel)
                .ok(),
            Some(None)
        );
        assert_eq!(
            args(OriginalSourceMode::Off, 0x53a).decide(Ok(())).ok(),
            Some(None)
        );
        let on = args(OriginalSourceMode::On, 0x53a)
            .decide(Ok(()))
            .ok()
            .flatten();
        assert_eq!(
            on.map(|o| (o.routing.mark, o.required)),
            Some((0x53a, true))
        );
    }
}
