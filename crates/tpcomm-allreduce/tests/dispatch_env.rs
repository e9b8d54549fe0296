//! The dispatch table file named by `TPCOMM_DISPATCH_TABLE` is what `CustomAllReduce::new`
//! uses when its `Config` names no table, and a file it cannot read fails every rank. Its
//! own test binary: the variable is process-wide, and no other suite may see it set.

mod common;

use common::{group, new_ar, R};
use tpcomm_allreduce::dispatch::{DispatchTable, DISPATCH_TABLE_ENV};
use tpcomm_allreduce::{Algorithm, AllReduceError, Config};

#[test]
fn the_file_the_environment_names_chooses_the_algorithm_and_a_bad_one_fails_every_rank() {
    let dir = std::env::temp_dir().join(format!("tpcomm-dispatch-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("table.txt");
    // 8 KiB eager calls on 2 ranks: two-stage in the built-in table, one-stage here.
    std::fs::write(
        &path,
        "# tuned\ntpcomm-dispatch 1\nbackend host\n2 * staged 0 inf 1stage\n",
    )
    .unwrap();
    // SAFETY: no other thread of this binary reads the environment while it changes: this
    // is its only test, and no rank thread runs now.
    unsafe { std::env::set_var(DISPATCH_TABLE_ENV, &path) };
    let chosen = group(2).run(|comm| -> R<(Algorithm, String)> {
        let mut ar = new_ar(&comm, Config::default())?;
        let (input, mut out) = (vec![1f32; 2048], vec![0f32; 2048]);
        let algorithm = ar.all_reduce(&input, &mut out)?;
        assert_eq!(out, vec![2f32; 2048]);
        Ok((algorithm, ar.dispatch_table().origin().to_string()))
    });
    for r in chosen {
        let (algorithm, origin) = r.unwrap().unwrap();
        assert_eq!(algorithm, Algorithm::OneStage);
        assert_eq!(origin, path.display().to_string());
    }
    // A table in the Config wins over the environment's.
    let explicit = group(2).run(|comm| -> R<String> {
        let config = Config {
            dispatch: Some(DispatchTable::host()),
            ..Config::default()
        };
        Ok(new_ar(&comm, config)?.dispatch_table().origin().to_string())
    });
    for r in explicit {
        assert_eq!(r.unwrap().unwrap(), DispatchTable::host().origin());
    }
    std::fs::write(
        &path,
        "tpcomm-dispatch 1\nbackend host\n2 f32 staged 0 4KiB 1stage\n",
    )
    .unwrap();
    let refused = group(2).run(|comm| new_ar(&comm, Config::default()).map(drop));
    for r in refused {
        match r.unwrap() {
            Err(AllReduceError::DispatchTable(e)) => {
                assert_eq!(e.line, Some(3));
                assert!(e.to_string().contains("table.txt, line 3"), "{e}");
            }
            other => panic!("expected the table refused, got {other:?}"),
        }
    }
    // SAFETY: as above; the rank threads have ended.
    unsafe { std::env::remove_var(DISPATCH_TABLE_ENV) };
    std::fs::remove_dir_all(&dir).unwrap();
}
