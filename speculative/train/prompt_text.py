"""The natural-language prompt families: chat questions, writing tasks and
explanations, as templates crossed with the word lists of ``prompt_topics``.

Every list is crossed with several phrasings (a user asks the same thing many
ways, and a draft model should not learn one phrasing). Where a full cross
would repeat one subject too often, each item gets a fixed number of phrasings
drawn at random. The randomness has a fixed seed: a family is the same set of
prompts on every machine with the same Python, and ``build_prompts`` samples it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from speculative.train import prompt_topics as t
from speculative.train.prompt_stdlib import reference_paragraphs

UNIVERSAL = (
    "What are three interesting facts about {topic}?",
    "Can you give me a short overview of {topic}?",
    "What are some common misconceptions about {topic}?",
    "Tell me something surprising about {topic}.",
    "I'd like to learn more about {topic}. Where should I start?",
    "What questions would you ask an expert on {topic}?",
    "Summarise what everyone should know about {topic} in five bullet points.",
    "Why do people find {topic} so fascinating?",
)
CHAT = (
    (
        t.SCIENCE,
        (
            *UNIVERSAL,
            "What is the science behind {topic}?",
            "What do scientists still not fully understand about {topic}?",
            "How did scientists first learn about {topic}?",
            "What simple experiment could help a student understand {topic}?",
            "What are the biggest recent discoveries related to {topic}?",
            "Can you explain {topic} without using any jargon?",
        ),
    ),
    (
        t.HISTORY,
        (
            *UNIVERSAL,
            "What were the main causes of {topic}?",
            "What were the long-term consequences of {topic}?",
            "Who were the key people involved in {topic}?",
            "How did {topic} affect ordinary people at the time?",
            "How do historians today view {topic}?",
            "What is one thing most people get wrong about {topic}?",
        ),
    ),
    (
        t.PLACES,
        (
            *UNIVERSAL,
            "What is the climate like in {topic} throughout the year?",
            "How has geography shaped the history of {topic}?",
            "What is {topic} best known for?",
            "What is the food culture like in {topic}?",
            "I'm planning {a_days}-day trip to {topic}. What should I not miss?",
            "What should I pack for a trip to {topic} in {season}?",
            "Which local dishes should I try when I visit {topic}?",
            "How can I get around {topic} on a tight budget?",
            "Is {topic} a good destination for {traveller}?",
            "What customs or etiquette should visitors to {topic} know about?",
            "Can you suggest a relaxed {days}-day itinerary for {topic}?",
            "What is the best time of year to visit {topic}, and why?",
        ),
    ),
    (
        t.TECHNOLOGY,
        (
            *UNIVERSAL,
            "Can you explain the basic idea behind {topic}?",
            "What should I consider before I start using {topic}?",
            "Are there any privacy or safety concerns with {topic}?",
            "What has changed about {topic} over the last decade?",
            "What are the main things that can go wrong with {topic}?",
        ),
    ),
    (
        t.MONEY,
        (
            "What should a young adult know about {topic}?",
            "What do people often get wrong about {topic}?",
            "Can you explain {topic} in simple terms?",
            "What's a sensible way to think about {topic}?",
            "Can you give me a quick overview of {topic}?",
            "What questions should I ask a financial adviser about {topic}?",
            "What are the basics of {topic} that nobody taught me at school?",
            "What would a sensible first step be when it comes to {topic}?",
        ),
    ),
    (
        t.ANIMALS,
        (
            *UNIVERSAL,
            "How do {topic} communicate with each other?",
            "What do {topic} eat, and how do they find their food?",
            "What are the biggest threats {topic} face in the wild?",
            "What makes {topic} unusual compared with other animals?",
            "How intelligent are {topic}?",
            "Where do {topic} live, and how are they adapted to it?",
            "What are some fun facts about {topic} for a child?",
        ),
    ),
    (
        t.HOBBIES,
        (
            *UNIVERSAL,
            "How can I get started with {topic}?",
            "What equipment do I really need for {topic}?",
            "How long does it usually take to get good at {topic}?",
            "How do I stay motivated with {topic} when progress feels slow?",
            "What would be a good goal for my first year of {topic}?",
            "Is {topic} an expensive hobby, and how can I keep the costs down?",
            "What are some common beginner mistakes in {topic}?",
        ),
    ),
    (
        t.HEALTH,
        (
            "What are some practical tips for {topic}?",
            "How can I make {topic} part of my daily routine?",
            "What does research generally say about {topic}?",
            "What are common mistakes people make when it comes to {topic}?",
            "Could you give me a simple one-week plan for {topic}?",
            "I struggle with {topic}. Where should I begin?",
        ),
    ),
    (
        t.DISHES,
        (
            "Can you give me a simple recipe for {topic}?",
            "What are common mistakes people make when cooking {topic}?",
            "How can I make {topic} a little healthier without losing flavour?",
            "What should I serve alongside {topic}?",
            "I'm making {topic} for {guests}. How much should I make, and what can I prepare ahead?",
            "What's the secret to really good {topic}?",
            "How long can I keep leftover {topic} in the fridge?",
        ),
    ),
    (
        t.INGREDIENTS,
        (
            "What's the best way to store {topic}?",
            "What can I use as a substitute for {topic} in a recipe?",
            "What are some easy ways to use up leftover {topic}?",
            "What are the nutritional benefits of {topic}?",
        ),
    ),
    (
        t.TASKS,
        (
            "How do I {topic}?",
            "What's the easiest way to {topic}?",
            "Can you walk me through how to {topic}, step by step?",
            "I've never had to {topic} before. Any advice?",
            "What mistakes should I avoid when I {topic}?",
            "What do I need to {topic}?",
        ),
    ),
    (
        t.SITUATIONS,
        (
            "{topic}. What should I do?",
            "{topic}. Do you have any advice?",
            "Can you help me think this through? {topic}.",
            "{topic}. How would you handle it?",
        ),
    ),
)
DAYS = ("three", "four", "five", "six", "seven", "eight", "ten", "eleven", "twelve", "fourteen")
EXTRA = {"days": DAYS, "season": t.SEASONS, "traveller": t.TRAVELLERS, "guests": t.GUESTS}

EXPLAIN = (
    "Explain {concept} to {audience}.",
    "How would you explain {concept} to {audience}?",
    "Can you explain {concept} in a way that {audience} would understand?",
    "I need to explain {concept} to {audience}. Can you help me find a good analogy?",
    "Explain {concept} to {audience} in three short paragraphs.",
    "Give {audience} a simple explanation of {concept}, with one everyday example.",
    "Write a short explanation of {concept} for {audience}, avoiding technical terms.",
    "What is the simplest way to explain {concept} to {audience}?",
)
EXPLAIN_PLAIN = (
    "Explain {concept} using an analogy.",
    "Explain {concept} in one paragraph, then give an example.",
    "Explain {concept}, and tell me why it matters.",
    "I've never really understood {concept}. Can you explain it simply?",
    "What are the most important ideas to grasp about {concept}?",
)
COMPARE = (
    "What is the difference between {a} and {b}?",
    "Compare {a} and {b}.",
    "How do {a} and {b} differ, and when does the difference matter?",
    "Can you explain {a} versus {b}, with an example of each?",
    "People often confuse {a} and {b}. How can I tell them apart?",
    "Make a table comparing {a} and {b}.",
    "Explain the difference between {a} and {b} to {audience}.",
    "In two short paragraphs, compare {a} with {b}.",
)
PROS_CONS = (
    "What are the pros and cons of {x}?",
    "Give me a balanced view of {x}: the main advantages and disadvantages.",
    "List three advantages and three disadvantages of {x}.",
    "Is {x} a good idea? Walk me through the arguments on both sides.",
    "A friend is thinking about {x}. What should they weigh up?",
    "What are the strongest arguments for and against {x}?",
    "Make a pros and cons table for {x}.",
    "What do people usually overlook when they think about {x}?",
)

EMAIL = (
    "Write a {tone} email {purpose}.",
    "Draft a short, {tone} email {purpose}.",
    "Can you help me write an email {purpose}? Keep it {tone}.",
    "Compose a {tone} message {purpose}, in no more than {n} sentences.",
)
STORY = (
    "Write a {length} story about {character} who {plot}.",
    "Tell me {a_genre} story in which {character} {plot}.",
    "Write the opening paragraph of {a_genre} novel about {character} who {plot}.",
    "Write a bedtime story for {an_age}-year-old about {character} who {plot}.",
    "Write a {length} story, told in the first person, about {character} who {plot}.",
    "Can you write me a {length} {genre} story? The main character is {character} who {plot}.",
    "Write a short scene, mostly dialogue, in which {character} {plot}.",
)
POEM = (
    "Write {a_form} about {subject}.",
    "Write {a_mood} {form} about {subject}.",
    "Compose {a_form} inspired by {subject}.",
    "Could you write me {a_mood} {form} about {subject}?",
    "Write {a_form} about {subject} for a greeting card.",
)
PRODUCT = (
    "Write a {words}-word product description {channel} for {product}, aimed at {buyer}.",
    "Write a {tone} product description for {product} {channel}.",
    "Describe {product} in a way that would appeal to {buyer}. Keep it under {words} words.",
    "Write three catchy taglines for {product} that would appeal to {buyer}.",
    "Write a short advert for {product} aimed at {buyer}.",
)
BLOG = (
    "Write an outline for a blog post about {topic}.",
    "Write an engaging opening paragraph for a blog post about {topic}.",
    "Suggest five catchy titles for a blog post about {topic}.",
    "Write a short newsletter item about {topic} for a community magazine.",
)
COVER_LETTER = (
    "Write a cover letter for {a_job} position for someone who {background}.",
    "Write a short, confident cover letter for an applicant who {background} and wants a job as {a_job}.",
    "What should a cover letter for {a_job} role say if the applicant {background}? Write an example.",
)
SPEECH = (
    "Write a {tone} speech for {occasion}.",
    "Write a two-minute toast for {occasion}. Keep it {tone}.",
    "Write a {tone} opening line and a closing line for a speech at {occasion}.",
)
REVIEW = (
    "Write a {stars}-star customer review of {product}.",
    "Write a believable {stars}-star review of {product}, mentioning one specific detail.",
    "Imagine you bought {product}. Write a {stars}-star review explaining why.",
)
SUMMARY = (
    "Summarise the following passage in {n} sentences:\n\n{text}",
    "Rewrite this paragraph so that a beginner can understand it:\n\n{text}",
    "Turn this paragraph into a short list of bullet points:\n\n{text}",
    "Write a one-sentence summary of this text:\n\n{text}",
    "Give this paragraph a clear title and a two-sentence summary:\n\n{text}",
)
DIALOGUE = "Write a short dialogue between {c1} and {c2} about {subject}."
CODING = (
    "Write a {language} function that {task}.",
    "How would I write a {language} function that {task}?",
    "Show me {language} code that {task}, with a short explanation.",
    "Write a {language} function that {task}, and include a few test cases.",
    "I'm learning {language}. Can you show me how to write a function that {task}?",
    "Write a well-documented {language} function that {task}.",
)


def an(phrase: str) -> str:
    """``phrase`` with its indefinite article (by spelling, which suits these lists)."""
    return ("an " if phrase[0].lower() in "aeiou" else "a ") + phrase


def chat_prompts(seed: int = 0) -> Iterator[str]:
    """Every topic with every phrasing of its list (travel and cooking details drawn at random)."""
    rng = random.Random(seed)
    for topics, templates in CHAT:
        for topic, template in itertools.product(topics, templates):
            extra = {key: rng.choice(pool) for key, pool in EXTRA.items()}
            yield template.format(topic=topic, a_days=an(extra["days"]), **extra)


def explanation_prompts(seed: int = 0, per_concept: int = 26) -> Iterator[str]:
    """Concepts for ``per_concept`` random (audience, phrasing) pairs plus one plain
    phrasing; every comparison and every pros-and-cons question in every phrasing."""
    rng = random.Random(seed)
    pairs = list(itertools.product(t.AUDIENCES, EXPLAIN))
    for concept in t.CONCEPTS:
        for audience, template in rng.sample(pairs, per_concept):
            yield template.format(concept=concept, audience=audience)
        yield rng.choice(EXPLAIN_PLAIN).format(concept=concept)
    for pair, template in itertools.product(t.COMPARISONS, COMPARE):
        a, b = pair.split(" vs ")
        yield template.format(a=a, b=b, audience=rng.choice(t.AUDIENCES))
    for x, template in itertools.product(t.DECISIONS, PROS_CONS):
        yield template.format(x=x)


def writing_prompts(seed: int = 0) -> Iterator[str]:
    """Emails, stories, poems, product copy, blog posts, cover letters, speeches,
    reviews, summaries of the language reference's prose, and dialogues."""
    rng = random.Random(seed)
    for purpose, tone in itertools.product(t.EMAILS, t.TONES):
        for template in rng.sample(EMAIL, 2):
            yield template.format(purpose=purpose, tone=tone, n=rng.choice(("three", "four", "five", "six")))
    for character, plot in itertools.product(t.CHARACTERS, t.PLOTS):
        genre = rng.choice(t.GENRES)
        yield rng.choice(STORY).format(
            character=character,
            plot=plot,
            genre=genre,
            a_genre=an(genre),
            length=rng.choice(t.STORY_LENGTHS),
            an_age=an(rng.choice(("three", "four", "five", "six", "seven", "eight", "nine"))),
        )
    for subject, form in itertools.product(t.POEM_SUBJECTS, t.POEM_FORMS):
        mood = rng.choice(t.MOODS)
        for template in rng.sample(POEM, 2):
            yield template.format(subject=subject, form=form, a_form=an(form), a_mood=an(mood))
    for product, buyer in itertools.product(t.PRODUCTS, t.BUYERS):
        yield rng.choice(PRODUCT).format(
            product=product,
            buyer=buyer,
            tone=rng.choice(t.PRODUCT_TONES),
            channel=rng.choice(t.CHANNELS),
            words=rng.choice((50, 80, 100, 150)),
        )
    for topic in t.HOBBIES + t.HEALTH + t.MONEY + t.TECHNOLOGY:
        yield from (template.format(topic=topic) for template in rng.sample(BLOG, 2))
    for job, background in itertools.product(t.JOBS, t.BACKGROUNDS):
        yield from (template.format(a_job=an(job), background=background) for template in rng.sample(COVER_LETTER, 2))
    for occasion, tone in itertools.product(t.OCCASIONS, t.SPEECH_TONES):
        yield from (template.format(occasion=occasion, tone=tone) for template in rng.sample(SPEECH, 2))
    for product, stars in itertools.product(t.PRODUCTS, range(1, 6)):
        yield rng.choice(REVIEW).format(product=product, stars=stars)
    for text in reference_paragraphs():
        yield rng.choice(SUMMARY).format(text=text, n=rng.choice(("two", "three")))
    for subject in t.POEM_SUBJECTS:
        c1, c2 = rng.sample(t.CHARACTERS, 2)
        yield DIALOGUE.format(c1=c1, c2=c2, subject=subject)


def coding_prompts(seed: int = 0, per_task: int = 4) -> Iterator[str]:
    """Everyday programming tasks, each asked ``per_task`` ways in random languages
    (Python five times in thirteen): the code family's requests not tied to the stdlib."""
    rng = random.Random(seed)
    for task in t.CODE_TASKS:
        for template in rng.sample(CODING, per_task):
            yield template.format(language=rng.choice(t.LANGUAGES), task=task)
