//! Planning: the cost model ([`cost`]), the event-driven step simulator ([`dag`],
//! [`step`]), candidate layouts ([`layout`]) and the search over them ([`search`]).

pub mod baseline;
pub mod bound;
pub mod check;
pub mod cost;
pub mod dag;
pub mod lanes;
pub mod layout;
mod options;
mod pick;
mod span;
pub mod step;
mod windows;

pub use cost::{Cost, Memory, StageCost};
pub use layout::{Layout, Placement, Plan, Schedule};
pub use step::{Problem, StepSim};
pub mod search;
pub use pick::{closest_to_baseline, mean_sim};
pub use search::{Found, Outcome, Space, search};
