//! Unit tests of how a same-process alias reaches its allocation (`alias_access`).

use super::*;

#[test]
fn an_alias_on_the_importers_device_needs_nothing() {
    assert_eq!(alias_access(0, 0, 0).unwrap(), AliasAccess::SameDevice);
}

#[test]
fn an_alias_on_another_device_needs_peer_access_to_it() {
    assert_eq!(alias_access(0, 3, 3).unwrap(), AliasAccess::Peer(3));
    assert_eq!(alias_access(2, 1, 1).unwrap(), AliasAccess::Peer(1));
}

#[test]
fn an_alias_whose_memory_moved_to_another_device_is_refused() {
    match alias_access(0, 1, 2) {
        Err(IpcError::InvalidHandle(why)) => {
            assert!(
                why.contains("device 1") && why.contains("device 2"),
                "{why}"
            )
        }
        other => panic!("{other:?}"),
    }
}
