use super::missing_symbols;

/// Without a driver, the probe fails with the names it tried; with one, a made-up symbol
/// is reported missing and a real one is not. Either way it returns instead of panicking.
#[test]
fn probe_reports_instead_of_panicking() {
    match missing_symbols(&["cuInit", "tpcommNoSuchSymbol"]) {
        Ok(missing) => assert_eq!(missing, ["tpcommNoSuchSymbol"]),
        Err(message) => {
            assert!(message.contains("libcuda.so.1"), "{message}");
            // Asked again, the cached failure comes back the same.
            assert_eq!(missing_symbols(&["cuInit"]), Err(message));
        }
    }
}
