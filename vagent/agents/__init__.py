"""Agent profiles: the native protocols of published "thinking with images/videos" agents, run by vagent's one
engine, encoder and toolbox (see ``docs/guide/agents.md``).

``PROFILES`` lists them explicitly; a new profile is one module implementing ``AgentProfile`` plus one entry here.
"""

from __future__ import annotations

from vagent.agents import (
    chain_of_focus,
    deepeyes,
    deepeyesv2,
    longvt,
    mini_o3,
    openthinkimg,
    pixel_reasoner,
    thyme,
    tool_star,
    vagent,
    visual_arft,
)
from vagent.agents.profile import AgentLimits, AgentProfile

__all__ = ["PROFILES", "AgentLimits", "AgentProfile", "get_profile"]

PROFILES: dict[str, AgentProfile] = {
    vagent.PROFILE.name: vagent.PROFILE,
    deepeyes.PROFILE.name: deepeyes.PROFILE,
    pixel_reasoner.PROFILE.name: pixel_reasoner.PROFILE,
    longvt.PROFILE.name: longvt.PROFILE,
    deepeyesv2.PROFILE.name: deepeyesv2.PROFILE,
    visual_arft.PROFILE.name: visual_arft.PROFILE,
    tool_star.PROFILE.name: tool_star.PROFILE,
    openthinkimg.PROFILE.name: openthinkimg.PROFILE,
    mini_o3.PROFILE.name: mini_o3.PROFILE,
    chain_of_focus.PROFILE.name: chain_of_focus.PROFILE,
    thyme.PROFILE.name: thyme.PROFILE,
}


def get_profile(agent: str | AgentProfile) -> AgentProfile:
    """The profile named ``agent`` (a profile object passes through). Unknown names raise ``KeyError`` listing
    the known ones (a configuration error)."""
    if not isinstance(agent, str):
        return agent
    if agent not in PROFILES:
        raise KeyError(f"unknown agent profile {agent!r}; available: {', '.join(PROFILES)}")
    return PROFILES[agent]
