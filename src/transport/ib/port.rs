//! Words for a port's attributes (link layer, state) that discovery
//! ([`super::device`]) and the iWARP rules ([`super::iwarp`]) both use. A
//! leaf: it imports nothing of the transport, so `device -> iwarp` needs no
//! edge back.

/// IBV_LINK_LAYER_INFINIBAND.
pub const LINK_IB: u8 = 1;
/// IBV_LINK_LAYER_ETHERNET.
pub const LINK_ETH: u8 = 2;

/// Text of an IBV_PORT_* state.
pub fn port_state_name(s: u32) -> &'static str {
    match s {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    }
}
