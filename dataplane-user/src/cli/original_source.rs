//! Flags of the original-source feature: the engine connects to apps from
//! their clients' own addresses (see `proxy::original_source`). They
//! convert into the plain [`OriginalSourceConfig`], checked.

use clap::{Args, ValueEnum};

use crate::agent::config::{OriginalSourceConfig, OriginalSourceMode};

/// The values of `--original-source` (their docs are the flag's help).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OriginalSourceFlag {
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

impl From<OriginalSourceFlag> for OriginalSourceMode {
    fn from(flag: OriginalSourceFlag) -> Self {
        match flag {
            OriginalSourceFlag::Auto => Self::Auto,
            OriginalSourceFlag::On => Self::On,
            OriginalSourceFlag::Off => Self::Off,
        }
    }
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
    pub original_source: OriginalSourceFlag,
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
}

impl OriginalSourceArgs {
    /// The feature's configuration; the transparent mark is checked
    /// against `proxy_mark` unless the feature is off.
    pub fn to_config(
        &self,
        proxy_mark: u32,
    ) -> Result<OriginalSourceConfig, OriginalSourceArgsError> {
        let config = OriginalSourceConfig {
            mode: self.original_source.into(),
            mark: self.transparent_mark,
            table: self.original_source_table,
        };
        if config.mode != OriginalSourceMode::Off
            && (self.transparent_mark == 0 || self.transparent_mark == proxy_mark)
        {
            return Err(OriginalSourceArgsError::Mark {
                mark: self.transparent_mark,
                proxy_mark,
            });
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(mode: OriginalSourceFlag, mark: u32) -> OriginalSourceArgs {
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
            args(OriginalSourceFlag::Auto, proxy).to_config(proxy),
            Err(OriginalSourceArgsError::Mark { .. })
        ));
        assert!(args(OriginalSourceFlag::On, 0).to_config(proxy).is_err());
        // Off exempts no second mark, whatever the flag says.
        assert_eq!(
            args(OriginalSourceFlag::Off, proxy)
                .to_config(proxy)
                .ok()
                .map(|c| c.kernel_mark()),
            Some(0)
        );
        assert_eq!(
            args(OriginalSourceFlag::Auto, 0x53a)
                .to_config(proxy)
                .ok()
                .map(|c| c.kernel_mark()),
            Some(0x53a)
        );
    }
}
