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

#[test]
fn an_abandon_hook_runs_once_on_abandonment_and_not_once_cleared() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let ran = Arc::new(AtomicUsize::new(0));
    let hook = |ran: &Arc<AtomicUsize>| -> Box<dyn FnOnce() + Send> {
        let ran = ran.clone();
        Box::new(move || {
            ran.fetch_add(1, Ordering::SeqCst);
        })
    };
    // Cleared before abandonment: never runs.
    let control = RunControl::background(1.0);
    control.on_abandon(hook(&ran));
    control.clear_on_abandon();
    control.abandon();
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // Set, then abandoned twice: runs once.
    let control = RunControl::background(1.0);
    control.on_abandon(hook(&ran));
    control.abandon();
    control.abandon();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    // Set after abandonment: runs at once.
    control.on_abandon(hook(&ran));
    assert_eq!(ran.load(Ordering::SeqCst), 2);
}
