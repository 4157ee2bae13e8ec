//! What `--pm` needs settled before serve starts: the flags checked, the experts file read,
//! the combinations refused, and the plan checked to relay chats to a plain backend. Called by
//! serve's start, on the main thread, before any process starts.

use onebit_plugin_api::Plan;

use onebit_command::cli::ServeArgs;
use onebit_command::error::Fatal;

/// `--pm`, `--pm-experts`, `--lemonade-url`: the experts file and Lemonade's address checked,
/// and the combinations refused, before anything starts.
pub fn settings(args: &ServeArgs) -> Result<Option<(super::Experts, super::LemonadeUrl)>, Fatal> {
    if !args.pm {
        if let Some(flag) = [
            (args.pm_experts.is_some(), "--pm-experts"),
            (args.lemonade_url.is_some(), "--lemonade-url"),
        ]
        .iter()
        .find(|(set, _)| *set)
        .map(|(_, f)| f)
        {
            return Err(Fatal::usage(format!(
                "{flag} only applies with --pm; add --pm or remove {flag}"
            )));
        }
        return Ok(None);
    }
    if args.laya || args.laya_model.is_some() {
        return Err(Fatal::usage(
            "--pm does not combine with --laya: the PM routes among models, Laya among devices; pick one",
        ));
    }
    if args.embedding || args.reranking {
        return Err(Fatal::usage(
            "--pm does not combine with --embedding/--reranking: the PM needs a chat model; remove one",
        ));
    }
    let experts = super::Experts::load(args.pm_experts.as_deref())?;
    let url =
        super::LemonadeUrl::parse(args.lemonade_url.as_deref().unwrap_or(super::DEFAULT_URL))?;
    Ok(Some((experts, url)))
}

/// The PM's rounds go to the backend the route relays chats to; a route that answers chats
/// otherwise (in process, or through its own forward, as hybrid's handoff does) cannot carry
/// them. What the route's rules say decides, not its name; the hybrid route also refuses
/// `--pm` in its own plan.
pub fn check_plan(plan: &Plan) -> Result<(), Fatal> {
    let relayed = plan.rules.iter().any(|r| {
        r.method.eq_ignore_ascii_case("POST")
            && r.path == super::CHAT_PATH
            && matches!(r.action, onebit_plugin_api::Action::Proxy { .. })
    });
    if !relayed {
        return Err(Fatal::usage(format!(
            "--pm does not run on --device {}: its chats are not relayed to a plain backend; use --device hrx or cpu",
            plan.device
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use onebit_plugin_api::{Action, Rule};

    use super::*;

    fn plan_whose_chats(device: &str, action: Action) -> Plan {
        Plan {
            device: device.to_string(),
            rules: vec![Rule {
                method: "POST".into(),
                path: crate::pm::CHAT_PATH.into(),
                action,
                inference: true,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn the_pm_runs_where_the_rules_relay_chats_whatever_the_routes_name() {
        assert!(check_plan(&plan_whose_chats("vendor", Action::Proxy { backend: 0 })).is_ok());
        for (device, action) in [
            ("hybrid", Action::AskRoute),
            ("inproc", Action::InProcess),
            ("cpu", Action::AskRoute),
        ] {
            let err = check_plan(&plan_whose_chats(device, action)).unwrap_err();
            assert!(
                err.to_string()
                    .contains(&format!("--pm does not run on --device {device}")),
                "{err}"
            );
        }
    }
}
