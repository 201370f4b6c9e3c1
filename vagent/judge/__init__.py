"""Clients of model endpoints used by judged rewards and judged evaluation: all reward I/O lives here.

``JudgeClient`` talks to any OpenAI-compatible server; ``judge_messages``/``parse_verdict`` are the prompts and
parsers of the three judge modes (``correct``, ``score``, ``pairwise``). Rewards stay pure: the recipe or the
eval runner calls the judge and hands the scores to ``vagent.rewards``.
"""

from vagent.judge.client import JudgeClient, JudgeReply
from vagent.judge.verdicts import MODES, TEMPLATES, Verdict, chat_messages, judge_messages, parse_verdict

__all__ = ["MODES", "TEMPLATES", "JudgeClient", "JudgeReply", "Verdict", "chat_messages", "judge_messages",
           "parse_verdict"]  # fmt: skip
