//! Certificate revocation lists (`--crl-path`) through two agents: the open
//! tunnel of a revoked client or server is reset and new ones are refused.

use super::*;

/// With `--crl-path` (ztunnel's `CRL_PATH`): once the file revokes the
/// certificate of `revoked` (`client` or `remote`), the open tunnel is reset
/// by the agent holding the file (`on`: the server's node, 2, or the
/// client's, 1) and new connections are refused in the handshake.
fn revocation_resets_and_refuses(tag: &str, on: u8, revoked: &str) -> anyhow::Result<()> {
    let mesh = TwoNodes::new(tag)?;
    let config = mesh.config()?;
    let crl = mesh.dir.path().join("ca-crl.pem");
    let crl_flag = crl.to_string_lossy().into_owned();
    let flags = |n: u8| -> Vec<&str> {
        if n == on {
            vec!["--crl-path", &crl_flag]
        } else {
            Vec::new()
        }
    };
    // The file is written once the first agent has created the CA; until
    // it exists, nothing is revoked.
    let a1 = mesh.agent("hb", 1, &config, &flags(1))?;
    let ca = dataplane_user::identity::Ca::load_or_generate(&mesh.shared_ca())?;
    std::fs::write(&crl, ca.revocation_list(&[], 1)?)?;
    let a2 = mesh.agent("hb", 2, &config, &flags(2))?;
    let _remote = echo_server(&mesh.remote, 9000)?;
    let _held = holding_server(&mesh.remote, 9100)?;
    echo(&mesh.client, addr(&mesh.remote, 9000), 1024, 1)?;
    let (owner, holder) = if revoked == "client" {
        (&a1, &a2)
    } else {
        (&a2, &a1)
    };
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let hold = scope.spawn(|| {
            try_stream(
                &mesh.client,
                &["hold-end", &addr(&mesh.remote, 9100).to_string(), "25"],
            )
        });
        std::thread::sleep(std::time::Duration::from_secs(2));
        let suffix = format!("/sa/{revoked}");
        let serials: Vec<Vec<u8>> = owner
            .certs()?
            .into_iter()
            .filter(|c| c.identity.ends_with(&suffix))
            .map(|c| {
                c.serial
                    .split(':')
                    .map(|b| u8::from_str_radix(b, 16))
                    .collect::<Result<Vec<u8>, _>>()
            })
            .collect::<Result<_, _>>()?;
        anyhow::ensure!(!serials.is_empty(), "no certificate of {revoked} listed");
        let revoked_at = std::time::Instant::now();
        std::fs::write(&crl, ca.revocation_list(&serials, 2)?)?;
        let held = hold
            .join()
            .map_err(|_| anyhow::anyhow!("hold thread panicked"))??;
        anyhow::ensure!(
            held.stdout != "open" && revoked_at.elapsed() < std::time::Duration::from_secs(15),
            "the open connection was not ended: {held:?}"
        );
        Ok(())
    })?;
    let out = try_stream(
        &mesh.client,
        &["echo", &addr(&mesh.remote, 9000).to_string(), "100", "2"],
    )?;
    anyhow::ensure!(
        out.code != Some(0),
        "connected despite the revocation: {out:?}"
    );
    let log = holder.log_text();
    anyhow::ensure!(
        log.contains("the peer's certificate was revoked") && log.contains("Revoked"),
        "the agent with the file logs the reset and the refusal:\n{log}"
    );
    Ok(())
}

#[test]
fn a_revoked_client_is_reset_and_then_refused() -> anyhow::Result<()> {
    revocation_resets_and_refuses("hbcrl", 2, "client")
}

#[test]
fn a_revoked_server_is_reset_and_then_refused() -> anyhow::Result<()> {
    revocation_resets_and_refuses("hbcrs", 1, "remote")
}
