"""Interview rehearsal: the topics list shipped with labkit, estimates and checked questions.

* ``topics.md``     the interview topics with ids (S1-S8, A1-A4, K1-K14, P1-P3), copied from the
                    project's notes so that a fresh clone has it (K13-K14 go beyond them).
* ``topics.py``     its parser.
* ``estimates.py``  the back-of-envelope numbers an answer needs, as plain functions built on
                    labkit's models (memory, alpha-beta, ResNet/GPT counts, Young/Daly, time
                    to train, HSDP against FSDP).
* ``scenarios.py``  the design scenarios' configurations (1.3B, BERT, 10B, 100B), each in one
                    place: the lessons and notebook 13 plan with the same objects.
* ``beyond.py``     long-context and mixture-of-experts arithmetic (K13, K14).
* ``questions.json`` the question bank: 2-4 questions per id, each a prompt over drawn
                    parameters, the labkit expression that answers it, a hint and a pointer.
* ``quiz.py``       loads the bank and draws an attempt; every expected answer is computed by
                    labkit code on the drawn numbers (``labkit.checks.interview`` grades).
"""
