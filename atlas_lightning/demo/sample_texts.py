"""Synthetic problem texts for the bundled sample: GPQA-style multiple choice and LCB-style code.

Every GPQA item is a small science computation with one right option and three distractors,
each distractor made by a named common mistake, so a wrong candidate has a plausible (flawed)
derivation. Every LCB item is a small stdin/stdout task with a correct program and buggy ones.
The texts are short (a problem ~50-150 tokens, an answer or program ~20-120) and need not be
solvable by a tiny model: the sample's point is the candidate structure (``sample.py``).

Who calls it: ``sample.py`` only. All randomness comes from the ``random.Random`` passed in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ChoiceItem:
    """A multiple-choice problem before lettering: ``options[0]`` is right, the rest distractors."""

    subset: str
    stem: str
    method: str  # what a solver says it did, e.g. "energy conservation"
    options: tuple[tuple[str, str], ...]  # (value shown as the option, derivation that leads to it)


@dataclass(frozen=True)
class CodeItem:
    """A coding problem: ``programs[0]`` is correct, the rest are buggy."""

    subset: str
    statement: str
    method: str
    programs: tuple[str, ...]


def fmt(x: float) -> str:
    """Three significant figures, no exponent for everyday magnitudes."""
    if x == 0:
        return "0"
    if not 1e-3 <= abs(x) < 1e6:
        return f"{x:.2e}"
    decimals = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{decimals}f}"


# ----------------------------------------------------------------------------- GPQA physics


def _free_fall(rng: random.Random) -> ChoiceItem:
    m, h = rng.choice([0.5, 1.0, 2.0, 3.5, 5.0]), rng.choice([1.2, 2.5, 3.5, 4.8, 6.0, 7.5, 9.0])
    g = 9.8
    right = math.sqrt(2 * g * h)
    return ChoiceItem(
        "physics",
        f"A {m} kg block starts from rest and slides down a frictionless ramp of vertical height "
        f"{h} m. Taking g = 9.8 m/s^2 and ignoring air resistance, what is the block's speed at the "
        "bottom of the ramp?",
        "energy conservation",
        (
            (f"{fmt(right)} m/s", f"m g h = m v^2 / 2, so v = sqrt(2 g h) = sqrt(2 * 9.8 * {h}) = {fmt(right)} m/s."),
            (f"{fmt(2 * g * h)} m/s", f"Kinetic energy equals m g h, so v = 2 g h = {fmt(2 * g * h)} m/s."),
            (f"{fmt(math.sqrt(g * h))} m/s", f"With m v^2 = m g h, v = sqrt(g h) = {fmt(math.sqrt(g * h))} m/s."),
            (f"{fmt(math.sqrt(2 * g * h * m))} m/s", f"v = sqrt(2 m g h) = {fmt(math.sqrt(2 * g * h * m))} m/s, keeping the mass."),
        ),
    )


def _projectile(rng: random.Random) -> ChoiceItem:
    v, theta = rng.choice([8, 12, 15, 20, 25, 30]), rng.choice([15, 20, 30, 35, 40, 50, 60])
    g = 9.8
    rad = math.radians(theta)
    right = v * v * math.sin(2 * rad) / g
    return ChoiceItem(
        "physics",
        f"A ball is launched from level ground at {v} m/s, {theta} degrees above the horizontal. "
        "Neglecting air resistance and taking g = 9.8 m/s^2, how far from the launch point does it land?",
        "projectile kinematics",
        (
            (f"{fmt(right)} m", f"Range R = v^2 sin(2 theta) / g = {v}^2 * sin({2 * theta} deg) / 9.8 = {fmt(right)} m."),
            (f"{fmt(v * v * math.sin(rad) / g)} m", f"R = v^2 sin(theta) / g = {fmt(v * v * math.sin(rad) / g)} m."),
            (f"{fmt(v * v * math.sin(2 * rad) / (2 * g))} m", f"Time of flight v sin(theta) / g, so R = {fmt(v * v * math.sin(2 * rad) / (2 * g))} m."),
            (f"{fmt(v * v / g)} m", f"Maximum range is v^2 / g = {fmt(v * v / g)} m."),
        ),
    )


def _parallel_resistors(rng: random.Random) -> ChoiceItem:
    r1, r2 = rng.sample([2, 3, 4, 5, 6, 8, 10, 12, 15, 20], 2)
    volts = rng.choice([3, 6, 9, 12, 24])
    right = volts * (1 / r1 + 1 / r2)
    return ChoiceItem(
        "physics",
        f"Two resistors of {r1} ohm and {r2} ohm are connected in parallel across an ideal "
        f"{volts} V battery. What total current does the battery deliver?",
        "Ohm's law for parallel resistors",
        (
            (f"{fmt(right)} A", f"R_eq = {r1}*{r2}/({r1}+{r2}) ohm, so I = V / R_eq = {fmt(right)} A."),
            (f"{fmt(volts / (r1 + r2))} A", f"Series sum R = {r1 + r2} ohm gives I = {fmt(volts / (r1 + r2))} A."),
            (f"{fmt(volts / r1)} A", f"The current through the first resistor is {fmt(volts / r1)} A."),
            (f"{fmt(volts * (r1 + r2) / (r1 * r2) / 2)} A", f"Average of the branch currents: {fmt(volts * (r1 + r2) / (r1 * r2) / 2)} A."),
        ),
    )


def _photon_energy(rng: random.Random) -> ChoiceItem:
    lam = rng.choice([250, 310, 400, 450, 500, 532, 589, 633, 700, 850])
    right = 1239.84 / lam
    return ChoiceItem(
        "physics",
        f"A laser emits photons of wavelength {lam} nm in vacuum. Using hc = 1239.84 eV nm, what is "
        "the energy of a single photon?",
        "Planck relation",
        (
            (f"{fmt(right)} eV", f"E = hc / lambda = 1239.84 / {lam} = {fmt(right)} eV."),
            (f"{fmt(lam / 1239.84)} eV", f"E = lambda / hc = {fmt(lam / 1239.84)} eV."),
            (f"{fmt(right / 10)} eV", f"Converting nm to angstrom first gives {fmt(right / 10)} eV."),
            (f"{fmt(right * 2)} eV", f"E = 2 hc / lambda = {fmt(right * 2)} eV."),
        ),
    )


def _pendulum(rng: random.Random) -> ChoiceItem:
    length = rng.choice([0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5])
    g = 9.8
    right = 2 * math.pi * math.sqrt(length / g)
    return ChoiceItem(
        "physics",
        f"A simple pendulum of length {length} m swings with small amplitude where g = 9.8 m/s^2. "
        "What is its period?",
        "small-angle pendulum",
        (
            (f"{fmt(right)} s", f"T = 2 pi sqrt(L / g) = 2 pi sqrt({length} / 9.8) = {fmt(right)} s."),
            (f"{fmt(2 * math.pi * math.sqrt(g / length))} s", f"T = 2 pi sqrt(g / L) = {fmt(2 * math.pi * math.sqrt(g / length))} s."),
            (f"{fmt(math.pi * math.sqrt(length / g))} s", f"Half a swing: T = pi sqrt(L / g) = {fmt(math.pi * math.sqrt(length / g))} s."),
            (f"{fmt(math.sqrt(length / g))} s", f"T = sqrt(L / g) = {fmt(math.sqrt(length / g))} s."),
        ),
    )


# ----------------------------------------------------------------------------- GPQA chemistry


def _molarity(rng: random.Random) -> ChoiceItem:
    grams, ml = rng.choice([2.5, 5.0, 5.85, 11.7, 14.6, 29.2]), rng.choice([100, 250, 500, 750])
    molar_mass = 58.44
    right = grams / molar_mass / (ml / 1000)
    return ChoiceItem(
        "chemistry",
        f"{grams} g of NaCl (molar mass 58.44 g/mol) is dissolved in water to make {ml} mL of "
        "solution. What is the molar concentration of NaCl?",
        "moles over volume",
        (
            (f"{fmt(right)} M", f"n = {grams} / 58.44 mol, V = {ml / 1000} L, so c = {fmt(right)} M."),
            (f"{fmt(grams / molar_mass / ml)} M", f"c = n / V with V = {ml}: {fmt(grams / molar_mass / ml)} M."),
            (f"{fmt(grams / 35.45 / (ml / 1000))} M", f"Using chlorine's 35.45 g/mol: c = {fmt(grams / 35.45 / (ml / 1000))} M."),
            (f"{fmt(grams / (ml / 1000))} M", f"c = mass / volume = {fmt(grams / (ml / 1000))} M."),
        ),
    )


def _strong_acid_ph(rng: random.Random) -> ChoiceItem:
    conc = rng.choice([0.2, 0.05, 0.01, 0.004, 0.002, 0.0005])
    right = -math.log10(conc)
    return ChoiceItem(
        "chemistry",
        f"What is the pH of a {conc} M aqueous solution of HCl at 25 C, assuming complete "
        "dissociation and ideal behaviour?",
        "strong acid dissociation",
        (
            (f"{right:.2f}", f"[H+] = {conc} M, so pH = -log10({conc}) = {right:.2f}."),
            (f"{14 - right:.2f}", f"pOH = -log10({conc}), pH = 14 - pOH = {14 - right:.2f}."),
            (f"{-math.log(conc):.2f}", f"pH = -ln[H+] = {-math.log(conc):.2f}."),
            (f"{-math.log10(conc / 2):.2f}", f"Half dissociates: pH = -log10({conc / 2}) = {-math.log10(conc / 2):.2f}."),
        ),
    )


def _ideal_gas(rng: random.Random) -> ChoiceItem:
    n, celsius, litres = rng.choice([0.5, 1.0, 1.5, 2.0]), rng.choice([0, 25, 37, 100, 150]), rng.choice([5, 10, 22.4, 30])
    r = 0.08206
    kelvin = celsius + 273.15
    right = n * r * kelvin / litres
    wrong_celsius = n * r * celsius / litres if celsius else n * r * 1.0 / litres
    return ChoiceItem(
        "chemistry",
        f"{n} mol of an ideal gas occupies {litres} L at {celsius} C. Using R = 0.08206 L atm/(mol K), "
        "what is its pressure?",
        "ideal gas law",
        (
            (f"{fmt(right)} atm", f"P = nRT / V = {n} * 0.08206 * {kelvin} / {litres} = {fmt(right)} atm."),
            (f"{fmt(wrong_celsius)} atm", f"P = nRT / V with T = {celsius}: {fmt(wrong_celsius)} atm."),
            (f"{fmt(n * 8.314 * kelvin / litres)} atm", f"With R = 8.314: P = {fmt(n * 8.314 * kelvin / litres)} atm."),
            (f"{fmt(r * kelvin / litres)} atm", f"P = RT / V = {fmt(r * kelvin / litres)} atm."),
        ),
    )


def _half_life(rng: random.Random) -> ChoiceItem:
    start, half, elapsed = rng.choice([10, 40, 80, 100, 250]), rng.choice([2, 5, 8, 12]), rng.choice([3, 6, 10, 15, 24])
    right = start * 0.5 ** (elapsed / half)
    return ChoiceItem(
        "chemistry",
        f"A sample holds {start} mg of a radioisotope with a half-life of {half} days. How much of the "
        f"isotope remains after {elapsed} days?",
        "first-order decay",
        (
            (f"{fmt(right)} mg", f"N = N0 (1/2)^(t / t_half) = {start} * 0.5^({elapsed}/{half}) = {fmt(right)} mg."),
            (f"{fmt(max(start * (1 - elapsed / (2 * half)), start * 0.01))} mg", "Linear loss of half per half-life gives "
             f"{fmt(max(start * (1 - elapsed / (2 * half)), start * 0.01))} mg."),
            (f"{fmt(start * 0.5 ** (half / elapsed))} mg", f"N = N0 (1/2)^(t_half / t) = {fmt(start * 0.5 ** (half / elapsed))} mg."),
            (f"{fmt(start * math.exp(-elapsed / half))} mg", f"N = N0 exp(-t / t_half) = {fmt(start * math.exp(-elapsed / half))} mg."),
        ),
    )


# ----------------------------------------------------------------------------- GPQA biology


def _hardy_weinberg(rng: random.Random) -> ChoiceItem:
    affected = rng.choice([0.0001, 0.0004, 0.0025, 0.01, 0.04, 0.09, 0.16])
    q = math.sqrt(affected)
    right = 2 * q * (1 - q)
    return ChoiceItem(
        "biology",
        f"In a population in Hardy-Weinberg equilibrium, {affected} of individuals show an autosomal "
        "recessive trait. What fraction of the population are heterozygous carriers?",
        "Hardy-Weinberg equilibrium",
        (
            (f"{fmt(right)}", f"q = sqrt({affected}) = {fmt(q)}, p = 1 - q, carriers 2pq = {fmt(right)}."),
            (f"{fmt(2 * q)}", f"q = {fmt(q)}, carriers 2q = {fmt(2 * q)}."),
            (f"{fmt((1 - q) ** 2)}", f"Carriers are p^2 = {fmt((1 - q) ** 2)}."),
            (f"{fmt(2 * affected * (1 - affected))}", f"Taking q = {affected}, 2pq = {fmt(2 * affected * (1 - affected))}."),
        ),
    )


def _doubling(rng: random.Random) -> ChoiceItem:
    start, doubling, elapsed = rng.choice([100, 500, 1000, 2000]), rng.choice([20, 30, 45]), rng.choice([60, 90, 120, 180, 240])
    right = start * 2 ** (elapsed / doubling)
    return ChoiceItem(
        "biology",
        f"A bacterial culture starts with {start} cells and divides every {doubling} minutes in "
        f"exponential phase. How many cells are there after {elapsed} minutes?",
        "exponential growth",
        (
            (fmt(right), f"{elapsed} / {doubling} = {fmt(elapsed / doubling)} doublings, N = {start} * 2^{fmt(elapsed / doubling)} = {fmt(right)}."),
            (fmt(start * 2 * elapsed / doubling), f"N = N0 * 2 * (t / d) = {fmt(start * 2 * elapsed / doubling)}."),
            (fmt(start * 2 ** (elapsed / doubling - 1)), f"The first division takes a doubling time: N = {fmt(start * 2 ** (elapsed / doubling - 1))}."),
            (fmt(start * (elapsed / doubling) ** 2), f"N = N0 (t / d)^2 = {fmt(start * (elapsed / doubling) ** 2)}."),
        ),
    )


def _monohybrid(rng: random.Random) -> ChoiceItem:
    n = rng.choice([3, 4, 5, 6])
    k = rng.randint(1, n - 1)
    right = math.comb(n, k) * 0.25 ** k * 0.75 ** (n - k)
    return ChoiceItem(
        "biology",
        f"Two heterozygous parents (Aa x Aa) have {n} children. What is the probability that exactly "
        f"{k} of them show the recessive phenotype aa?",
        "binomial Mendelian cross",
        (
            (fmt(right), f"P = C({n},{k}) (1/4)^{k} (3/4)^{n - k} = {fmt(right)}."),
            (fmt(0.25 ** k), f"P = (1/4)^{k} = {fmt(0.25 ** k)}."),
            (fmt(math.comb(n, k) * 0.5 ** n), f"Each child is aa with 1/2: C({n},{k}) / 2^{n} = {fmt(math.comb(n, k) * 0.5 ** n)}."),
            (fmt(0.25 ** k * 0.75 ** (n - k)), f"P = (1/4)^{k} (3/4)^{n - k} = {fmt(0.25 ** k * 0.75 ** (n - k))}."),
        ),
    )


def _codons(rng: random.Random) -> ChoiceItem:
    codons = rng.choice([51, 100, 134, 201, 300])
    length = 3 * codons
    return ChoiceItem(
        "biology",
        f"A mature mRNA coding region, from the AUG start codon through the stop codon inclusive, is "
        f"{length} nucleotides long. How many amino acids does the translated polypeptide contain?",
        "genetic code",
        (
            (str(codons - 1), f"{length} / 3 = {codons} codons; the stop codon adds none: {codons - 1}."),
            (str(codons), f"{length} / 3 = {codons} codons, one amino acid each: {codons}."),
            (str(codons - 2), f"Drop the start and the stop codons: {codons - 2}."),
            (str(length // 2), f"Two nucleotides per amino acid: {length // 2}."),
        ),
    )


GPQA_TEMPLATES: tuple[Callable[[random.Random], ChoiceItem], ...] = (
    _free_fall, _projectile, _parallel_resistors, _photon_energy, _pendulum,
    _molarity, _strong_acid_ph, _ideal_gas, _half_life,
    _hardy_weinberg, _doubling, _monohybrid, _codons,
)


def choice_item(rng: random.Random) -> ChoiceItem:
    """A random GPQA-style item whose four option values are distinct."""
    while True:
        item = rng.choice(GPQA_TEMPLATES)(rng)
        if len({value for value, _ in item.options}) == len(item.options):
            return item


# ----------------------------------------------------------------------------- LCB tasks


def _sum_divisible(rng: random.Random) -> CodeItem:
    k = rng.choice([2, 3, 5, 7])
    return CodeItem(
        "easy",
        f"You are given N integers. Print the sum of those that are divisible by {k}.\n"
        f"Input: the first line holds N; the second line holds N space-separated integers.\n"
        f"Output: one integer.\nExample: input '4\\n1 {k} {2 * k} {k + 1}' prints {3 * k}.",
        "single pass with a running sum",
        (
            f"n = int(input())\na = list(map(int, input().split()))\nprint(sum(x for x in a if x % {k} == 0))",
            f"n = int(input())\na = list(map(int, input().split()))\nprint(sum(x for x in a if x % {k} != 0))",
            f"n = int(input())\na = list(map(int, input().split()))\ns = 0\nfor i in range(n - 1):\n    if a[i] % {k} == 0:\n        s += a[i]\nprint(s)",
            f"n = int(input())\na = list(map(int, input().split()))\nprint(sum(i for i in range(n) if a[i] % {k} == 0))",
        ),
    )


def _count_pairs(rng: random.Random) -> CodeItem:
    return CodeItem(
        rng.choice(["easy", "medium"]),
        "Given N integers and a target T, count the pairs of indices i < j with a[i] + a[j] == T.\n"
        "Input: N and T on the first line, then N integers. Output: the count.\n"
        "Constraints: 1 <= N <= 2 * 10^5, so an O(N^2) scan is too slow.",
        "hash map of counts",
        (
            "n, t = map(int, input().split())\na = list(map(int, input().split()))\nseen = {}\nans = 0\n"
            "for x in a:\n    ans += seen.get(t - x, 0)\n    seen[x] = seen.get(x, 0) + 1\nprint(ans)",
            "n, t = map(int, input().split())\na = list(map(int, input().split()))\nseen = {}\nans = 0\n"
            "for x in a:\n    seen[x] = seen.get(x, 0) + 1\n    ans += seen.get(t - x, 0)\nprint(ans)",
            "n, t = map(int, input().split())\na = set(map(int, input().split()))\nprint(sum(1 for x in a if t - x in a) // 2)",
            "n, t = map(int, input().split())\na = list(map(int, input().split()))\n"
            "print(sum(1 for i in range(n) for j in range(n) if a[i] + a[j] == t))",
        ),
    )


def _longest_run(rng: random.Random) -> CodeItem:
    return CodeItem(
        "medium",
        "Given a sequence of N integers, print the length of its longest contiguous strictly "
        "increasing run.\nInput: N, then N integers. Output: one integer.\n"
        "Example: '6\\n1 2 2 3 4 1' prints 3.",
        "linear scan with a current-run counter",
        (
            "n = int(input())\na = list(map(int, input().split()))\nbest = cur = 1\nfor i in range(1, n):\n"
            "    cur = cur + 1 if a[i] > a[i - 1] else 1\n    best = max(best, cur)\nprint(best)",
            "n = int(input())\na = list(map(int, input().split()))\nbest = cur = 1\nfor i in range(1, n):\n"
            "    cur = cur + 1 if a[i] >= a[i - 1] else 1\n    best = max(best, cur)\nprint(best)",
            "n = int(input())\na = list(map(int, input().split()))\nbest = cur = 1\nfor i in range(1, n):\n"
            "    if a[i] > a[i - 1]:\n        cur += 1\n    else:\n        best = max(best, cur)\n        cur = 1\nprint(best)",
            "n = int(input())\na = list(map(int, input().split()))\nprint(sum(1 for i in range(1, n) if a[i] > a[i - 1]))",
        ),
    )


def _max_subarray(rng: random.Random) -> CodeItem:
    return CodeItem(
        "medium",
        "Given N integers (possibly all negative), print the largest sum of a non-empty contiguous "
        "subarray.\nInput: N, then N integers. Output: one integer.\n"
        "Constraints: 1 <= N <= 10^5, |a[i]| <= 10^9. Example: '5\\n-2 3 -1 4 -9' prints 6.",
        "Kadane's algorithm",
        (
            "n = int(input())\na = list(map(int, input().split()))\nbest = cur = a[0]\nfor x in a[1:]:\n"
            "    cur = max(x, cur + x)\n    best = max(best, cur)\nprint(best)",
            "n = int(input())\na = list(map(int, input().split()))\nbest = cur = 0\nfor x in a:\n"
            "    cur = max(0, cur + x)\n    best = max(best, cur)\nprint(best)",
            "n = int(input())\na = list(map(int, input().split()))\nprint(max(a))",
            "n = int(input())\na = list(map(int, input().split()))\nprint(sum(x for x in a if x > 0))",
        ),
    )


def _palindrome(rng: random.Random) -> CodeItem:
    return CodeItem(
        "easy",
        "Read one line of text. Print YES if it reads the same forwards and backwards when case is "
        "ignored and only letters and digits are kept; otherwise print NO.\n"
        "Constraints: the line has at most 10^5 characters.\n"
        "Example: 'Never odd, or even' prints YES; 'Ab, ba!' prints YES; 'abc' prints NO.",
        "normalise then compare with the reverse",
        (
            "s = [c.lower() for c in input() if c.isalnum()]\nprint('YES' if s == s[::-1] else 'NO')",
            "s = [c for c in input() if c.isalnum()]\nprint('YES' if s == s[::-1] else 'NO')",
            "s = input().lower()\nprint('YES' if s == s[::-1] else 'NO')",
            "s = [c.lower() for c in input() if c.isalnum()]\nprint('YES' if s[: len(s) // 2] == s[len(s) // 2 :] else 'NO')",
        ),
    )


def _coin_change(rng: random.Random) -> CodeItem:
    coins = rng.choice([(1, 3, 4), (1, 5, 6, 9), (1, 7, 10), (2, 5, 11)])
    return CodeItem(
        "hard",
        f"With unlimited coins of values {', '.join(map(str, coins))}, print the fewest coins that sum "
        "exactly to the amount X read from input, or -1 if impossible.\nInput: one line with X.\n"
        "Output: one integer. Constraints: 1 <= X <= 10^5. A greedy choice of the largest coin is not always optimal.",
        "dynamic programming over amounts",
        (
            f"x = int(input())\nc = {list(coins)}\nINF = float('inf')\ndp = [0] + [INF] * x\n"
            "for v in range(1, x + 1):\n    for k in c:\n        if k <= v and dp[v - k] + 1 < dp[v]:\n"
            "            dp[v] = dp[v - k] + 1\nprint(dp[x] if dp[x] < INF else -1)",
            f"x = int(input())\nans = 0\nfor k in sorted({list(coins)}, reverse=True):\n    ans += x // k\n    x %= k\n"
            "print(ans if x == 0 else -1)",
            f"x = int(input())\nc = {list(coins)}\nINF = float('inf')\ndp = [0] + [INF] * x\n"
            "for v in range(1, x):\n    for k in c:\n        if k <= v and dp[v - k] + 1 < dp[v]:\n"
            "            dp[v] = dp[v - k] + 1\nprint(dp[x] if dp[x] < INF else -1)",
            f"x = int(input())\nc = {list(coins)}\nprint(x // max(c) + (1 if x % max(c) else 0))",
        ),
    )


def _grid_paths(rng: random.Random) -> CodeItem:
    return CodeItem(
        "hard",
        "An H x W grid has blocked cells marked '#' and free cells '.'. Moving only right or down from "
        "the top-left to the bottom-right cell, count the paths modulo 10^9 + 7 (0 if a corner is "
        "blocked).\nInput: H W, then H rows.",
        "path-counting DP row by row",
        (
            "h, w = map(int, input().split())\ng = [input() for _ in range(h)]\nM = 10**9 + 7\ndp = [0] * w\n"
            "dp[0] = 1 if g[0][0] == '.' else 0\nfor i in range(h):\n    for j in range(w):\n"
            "        if g[i][j] == '#':\n            dp[j] = 0\n        elif j:\n            dp[j] = (dp[j] + dp[j - 1]) % M\nprint(dp[-1])",
            "h, w = map(int, input().split())\ng = [input() for _ in range(h)]\ndp = [0] * w\ndp[0] = 1\n"
            "for i in range(h):\n    for j in range(w):\n        if g[i][j] == '#':\n            dp[j] = 0\n"
            "        elif j:\n            dp[j] = dp[j] + dp[j - 1]\nprint(dp[-1])",
            "h, w = map(int, input().split())\ng = [input() for _ in range(h)]\nM = 10**9 + 7\ndp = [1] * w\n"
            "for i in range(1, h):\n    for j in range(1, w):\n        dp[j] = (dp[j] + dp[j - 1]) % M\nprint(dp[-1])",
            "from math import comb\nh, w = map(int, input().split())\nprint(comb(h + w - 2, h - 1) % (10**9 + 7))",
        ),
    )


def _range_sums(rng: random.Random) -> CodeItem:
    return CodeItem(
        "medium",
        "Given N integers and Q queries (l, r) with 1-based inclusive bounds, print the sum of "
        "a[l..r] for each query, one per line.\nInput: N Q, the array, then Q lines 'l r'. "
        "N, Q up to 2 * 10^5.",
        "prefix sums",
        (
            "n, q = map(int, input().split())\na = list(map(int, input().split()))\np = [0]\nfor x in a:\n"
            "    p.append(p[-1] + x)\nfor _ in range(q):\n    l, r = map(int, input().split())\n    print(p[r] - p[l - 1])",
            "n, q = map(int, input().split())\na = list(map(int, input().split()))\np = [0]\nfor x in a:\n"
            "    p.append(p[-1] + x)\nfor _ in range(q):\n    l, r = map(int, input().split())\n    print(p[r] - p[l])",
            "n, q = map(int, input().split())\na = list(map(int, input().split()))\nfor _ in range(q):\n"
            "    l, r = map(int, input().split())\n    print(sum(a[l:r]))",
            "n, q = map(int, input().split())\na = list(map(int, input().split()))\np = [0]\nfor x in a:\n"
            "    p.append(p[-1] + x)\nfor _ in range(q):\n    l, r = map(int, input().split())\n    print(p[r - 1] - p[l - 1])",
        ),
    )


def _distinct_count(rng: random.Random) -> CodeItem:
    k = rng.choice([2, 3, 4])
    return CodeItem(
        "easy",
        f"Given N integers, print how many distinct values appear at least {k} times.\n"
        "Input: N, then N integers. Output: one integer.\n"
        f"Constraints: 1 <= N <= 10^5, values fit in 32 bits. Example: '6\\n4 4 1 4 2 2' prints {sum(1 for count in (3, 2, 1) if count >= k)}.",
        "frequency table",
        (
            f"from collections import Counter\ninput()\nc = Counter(input().split())\nprint(sum(1 for v in c.values() if v >= {k}))",
            f"from collections import Counter\ninput()\nc = Counter(input().split())\nprint(sum(1 for v in c.values() if v > {k}))",
            "n = int(input())\nvalues = input().split()\nprint(len(set(values)))",
            f"from collections import Counter\ninput()\nc = Counter(input().split())\nprint(sum(v for v in c.values() if v >= {k}))",
        ),
    )


LCB_TEMPLATES: tuple[Callable[[random.Random], CodeItem], ...] = (
    _sum_divisible, _count_pairs, _longest_run, _max_subarray, _palindrome,
    _coin_change, _grid_paths, _range_sums, _distinct_count,
)


def code_item(rng: random.Random, difficulty: str) -> CodeItem:
    """A random LCB-style item of the given difficulty (``easy``, ``medium`` or ``hard``)."""
    while True:
        item = rng.choice(LCB_TEMPLATES)(rng)
        if item.subset == difficulty:
            return item
