//! The driver's hold on a running iteration: shares, holds, pauses and abandonment.

use std::sync::Arc;
use std::time::{Duration, Instant};

use salus_exec::RunControl;

#[test]
fn a_pause_lasts_its_length_when_nothing_changes() {
    let control = RunControl::background(0.5);
    let start = Instant::now();
    control.pause(Duration::from_millis(30));
    assert!(start.elapsed() >= Duration::from_millis(30));
}

#[test]
fn a_pause_ends_when_the_share_changes_or_the_iteration_is_abandoned() {
    for abandon in [false, true] {
        let control = Arc::new(RunControl::background(0.3));
        let driver = {
            let control = control.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                if abandon {
                    control.abandon();
                } else {
                    control.set_share(1.0);
                }
            })
        };
        let start = Instant::now();
        control.pause(Duration::from_secs(60));
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the pause outlasted the change (abandon: {abandon})"
        );
        driver.join().unwrap();
        assert_eq!(control.abandoned(), abandon);
        assert_eq!(control.share(), if abandon { 0.3 } else { 1.0 });
    }
}

#[test]
fn a_held_iteration_waits_for_a_share() {
    let control = Arc::new(RunControl::background(0.0));
    let driver = {
        let control = control.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            control.set_share(0.25);
        })
    };
    assert_eq!(control.wait_for_share(), 0.25);
    assert!(control.is_background());
    driver.join().unwrap();
}
