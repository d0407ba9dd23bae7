//! Certificate rotation under live connections, and the cache of client
//! configurations.

use super::*;

#[tokio::test]
async fn rotation_reaches_new_handshakes_and_spares_established_ones() {
    let mesh = mesh(Duration::from_secs(4));
    let (server, client) = (id(TD, "server"), id(TD, "client"));
    let _rotation = mesh.store.clone().spawn_rotation();
    let (addr, accepted) = serve(server_cfg(&mesh, &server), 2).await;
    let config = client_cfg(&mesh, &client, &server);

    let mut before = connect(config.clone(), addr).await.unwrap();
    ping(&mut before).await.unwrap();
    let old_serial = serial_of(&before);
    let old = mesh.store.get(&server).unwrap();

    // Half of a 4 s life is ~2 s; allow plenty for a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(20);
    while mesh
        .store
        .get(&server)
        .is_some_and(|now| Arc::ptr_eq(&now, &old))
    {
        assert!(Instant::now() < deadline, "certificate was not rotated");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut after = connect(config, addr).await.unwrap();
    ping(&mut after).await.unwrap();
    assert_ne!(
        serial_of(&after),
        old_serial,
        "new handshake got the old certificate"
    );
    assert_eq!(peer_identity(after.get_ref().1), Some(server));
    // The connection from before the rotation still carries data.
    ping(&mut before).await.unwrap();
    for outcome in accepted.await.unwrap() {
        assert_eq!(outcome.unwrap().peer, Some(client.clone()));
    }
}

#[test]
fn client_config_cache_reuses_configurations() {
    let mesh = mesh(Duration::from_secs(3600));
    let cache = ClientConfigCache::new(mesh.store.clone(), mesh.roots.clone(), 2);
    let (client, a, b, c) = (id(TD, "client"), id(TD, "a"), id(TD, "b"), id(TD, "c"));

    let first = cache.get(&client, &[a.clone(), b.clone()]).unwrap();
    let again = cache
        .get(&client, &[b.clone(), a.clone(), a.clone()])
        .unwrap();
    assert!(
        Arc::ptr_eq(&first, &again),
        "same key, different order, built twice"
    );
    let other = cache.get(&client, std::slice::from_ref(&c)).unwrap();
    assert!(!Arc::ptr_eq(&first, &other));
    cache.get(&client, &[a.clone(), b.clone()]).unwrap();
    // Over capacity: the least recently used ([c]) goes.
    cache.get(&client, std::slice::from_ref(&a)).unwrap();
    assert_eq!(cache.len(), 2);
    let rebuilt = cache.get(&client, &[c]).unwrap();
    assert!(!Arc::ptr_eq(&rebuilt, &other));
    assert!(matches!(
        cache.get(&client, &[]),
        Err(TlsError::NoExpectedIdentity)
    ));
}
