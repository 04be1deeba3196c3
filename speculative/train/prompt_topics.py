"""Word lists for the templated prompt families (``speculative.train.prompts``),
written for this project: topics, places, dishes, characters, concepts.

Each list is a ``;``- or newline-separated block, so a few hundred items stay a
few dozen lines; ``items`` splits it. An item must read naturally in every
template that uses its list, so each list states the grammatical shape its
templates expect (a plural noun, a gerund phrase, a verb phrase ...).
"""

from __future__ import annotations

import re


def items(block: str) -> tuple[str, ...]:
    """The items of a block: split on ``;`` and newlines, stripped, empties dropped."""
    return tuple(item.strip() for item in re.split(r"[;\n]", block) if item.strip())


# --- chat: noun phrases (singular or plural: their templates avoid verb agreement) ---
SCIENCE = items("""
black holes; photosynthesis; plate tectonics; the immune system; DNA; the water cycle; volcanoes; earthquakes
climate change; the theory of evolution; antibiotics; vaccines; the periodic table; gravity; static electricity
magnetism; the speed of light; sound waves; the human brain; sleep cycles; the carbon cycle; ocean currents; tides
the ozone layer; rainbows; lightning; nuclear fusion; stem cells; the gut microbiome; exoplanets; the Big Bang
dark matter; the phases of the Moon; solar eclipses; comets; the greenhouse effect; coral reefs; fossils
radioactivity; superconductors; enzymes; the human heart; long-term memory; the placebo effect; viruses; bacteria
heredity; crystals; hurricanes; glaciers; entropy; the Doppler effect; quantum mechanics; special relativity
chemical bonds; acids and bases; the nitrogen cycle; healthy soil; the human eye; the sense of smell; batteries
semiconductors; antimatter; neutron stars; the Northern Lights; ocean tides; mushrooms and fungi; bird migration
""")

HISTORY = items("""
the French Revolution; the Industrial Revolution; the Renaissance; the Cold War; the Age of Exploration
the Meiji Restoration; the fall of the Berlin Wall; the building of the Great Wall of China; the Black Death
the American Civil War; the Bronze Age collapse; the Ming dynasty; the Viking Age; the Great Depression
the space race; the Protestant Reformation; the Mongol Empire; the Ottoman Empire; the Roman Republic
the invention of the printing press; the Harlem Renaissance; the Irish Famine; the California Gold Rush
the partition of India; the Scientific Revolution; the Enlightenment; the Crusades; the Hundred Years' War
the Napoleonic Wars; the Aztec Empire; the Inca Empire; the Victorian era; the Tang dynasty; the Mughal Empire
the Silk Road; the first Olympic Games; the Apollo moon landings; the abolition of the slave trade
the women's suffrage movement; the civil rights movement; the Norman conquest of England; the Meiji era
the unification of Germany; the building of the pyramids of Giza; the Russian Revolution; ancient Athens
the Spanish flu of 1918; the fall of Constantinople; the construction of the Panama Canal
""")

PLACES = items("""
Japan; Peru; Iceland; Morocco; Vietnam; New Zealand; Portugal; Kenya; Norway; Mexico; Chile; Scotland; Greece
Thailand; Canada; Argentina; Egypt; India; Turkey; Croatia; South Korea; Ireland; Colombia; Finland; Tanzania
Jordan; Sri Lanka; Mongolia; Nepal; Costa Rica; Namibia; Switzerland; the Scottish Highlands; Patagonia
the Amalfi Coast; Tasmania; Bavaria; Provence; Andalusia; Sicily; Bali; Hokkaido; Quebec; Rajasthan; Yunnan
Cappadocia; Tuscany; Lapland; the Faroe Islands; Zanzibar; the Galapagos Islands; Kyoto; Lisbon; Istanbul
Mexico City; Buenos Aires; Cape Town; Vancouver; Copenhagen; Edinburgh; Hanoi; Marrakesh; Prague; Vienna
Seoul; Singapore; Melbourne; Montreal; Barcelona; Amsterdam; Krakow; Budapest; Oaxaca; Cusco; Reykjavik
Tbilisi; Ljubljana; Kerala; Sardinia; the Dolomites; Yorkshire; Brittany; Slovenia; Uruguay; Madagascar
""")

TRAVELLERS = items("""
a family with young children; a solo traveller; someone who uses a wheelchair; a couple on their honeymoon
a group of students on a budget; a keen hiker; someone who loves museums; a retired couple
a first-time traveller abroad; a vegetarian food lover; a photographer; someone who doesn't speak the language
""")

SEASONS = items("early spring; midsummer; late autumn; the middle of winter; the rainy season; the holiday season")

TECHNOLOGY = items("""
password managers; cloud storage; two-factor authentication; home Wi-Fi networks; smartphone batteries
open-source software; electric cars; 3D printing; rooftop solar panels; satellite navigation; smart speakers
public Wi-Fi; VPNs; email spam filters; QR codes; online banking; video calls; search engines
recommendation algorithms; machine translation; self-driving cars; e-readers; noise-cancelling headphones
heat pumps; induction hobs; computer viruses; end-to-end encryption; data backups; web browsers
website cookies; music streaming; fibre broadband; Bluetooth; fitness trackers; digital cameras; smart watches
""")

MONEY = items("""
building an emergency fund; index funds; credit scores; budgeting on a low income; paying off student loans
saving for retirement; buying a first car; renting a first flat; sharing finances as a couple; compound interest
inflation; running a small side business; tipping when abroad; insurance excess and deductibles
saving for a holiday; teaching children about money; tracking monthly spending; pension contributions
negotiating a salary; second-hand shopping; subscription services; paying for university; mortgages
""")

ANIMALS = items("""
octopuses; honeybees; wolves; emperor penguins; elephants; monarch butterflies; crows; dolphins; tardigrades
axolotls; sea turtles; bats; ants; hummingbirds; snow leopards; orangutans; jellyfish; beavers; owls; sharks
koalas; salmon; camels; chameleons; fireflies; red foxes; humpback whales; hedgehogs; parrots; cuttlefish
mantis shrimp; bison; flamingos; sloths; earthworms; vultures; squirrels; giraffes; otters; pangolins
""")

# --- chat: gerund phrases ---
HEALTH = items("""
getting better sleep; staying hydrated; reducing stress at work; stretching after exercise; eating more vegetables
keeping a good posture at a desk; starting to run; cutting down on sugar; managing screen time
protecting skin from the sun; building strength after forty; walking more every day; keeping teeth healthy
dealing with seasonal allergies; looking after mental health in winter; drinking less caffeine
preventing back pain; staying active while working from home; eating a good breakfast; taking short naps
meditating; keeping a healthy weight; reading food labels; taking breaks from screens; improving balance
staying fit while travelling; cooking healthy meals on a budget; keeping a regular bedtime; eating less salt
""")

HOBBIES = items("""
learning the guitar; birdwatching; knitting; playing chess; watercolour painting; rock climbing; photography
gardening; journaling; woodworking; baking bread; learning a new language; running marathons; pottery
calligraphy; playing the piano; open-water swimming; yoga; cycling; fishing; sewing; origami; drawing portraits
amateur astronomy; home brewing; writing short stories; singing in a choir; hiking; designing board games
magic tricks; beekeeping; podcasting; skateboarding; playing tennis; bouldering; embroidery; model railways
surfing; salsa dancing; geocaching; playing the ukulele; bonsai
""")

# --- chat: verb phrases ("How do I ...?") ---
TASKS = items("""
remove a red wine stain from a carpet; unclog a bathroom sink without harsh chemicals
keep houseplants alive in a dark flat; organise a small wardrobe; save money on groceries
prepare for a job interview; iron a shirt; fix a squeaky door; plan a child's birthday party
pack a suitcase efficiently; negotiate a lower phone bill; clean a cast iron pan; declutter a kitchen
start a vegetable garden on a balcony; fix a flat bicycle tyre; build a morning routine
set up a small home office; sharpen kitchen knives; wash a wool jumper; make new friends as an adult
hang a heavy mirror; reduce food waste at home; teach a puppy to sit; get rid of fruit flies
back up the photos on my phone; get my car ready for winter; paint a room; choose a ripe watermelon
fold a fitted sheet; study for an exam; learn to touch type; memorise a speech; split bills fairly with housemates
make a weekly meal plan; keep my inbox under control; clean windows without streaks; choose good running shoes
look after a leather jacket; repot a plant; remember people's names; stop procrastinating
write a good thank-you note; get a toddler to sleep through the night; bleed a radiator; descale a kettle
""")

# --- cooking: dish names without an article; ingredients ---
DISHES = items("""
banana bread; mushroom risotto; vegetable curry; lentil soup; pad thai; French omelettes; pizza dough
chicken noodle soup; guacamole; hummus; fluffy pancakes; shakshuka; tomato sauce from scratch; fried rice
chocolate chip cookies; roast chicken; ratatouille; falafel; miso soup; sourdough bread; apple pie
chilli con carne; Caesar salad; beef stew; vegetable lasagne; pork dumplings; fish tacos; paella; gazpacho
carrot cake; spaghetti carbonara; chicken biryani; crepes; homemade granola; pho; potato gratin; lemon tart
vegetable stir-fry; butter chicken; minestrone; mac and cheese; Spanish tortilla; scones; moussaka
""")

GUESTS = items("two people; four people; a family of five; a dinner party of eight; a potluck of twenty")

INGREDIENTS = items("""
fresh basil; eggs; ripe bananas; spinach; cooked rice; chickpeas; buttermilk; fresh ginger; lemons; avocados
coriander; stale bread; zucchini; tofu; lentils; plain yoghurt; mushrooms; sweet potatoes; oats; cabbage
honey; coconut milk; frozen peas; canned tomatoes; parmesan; fresh herbs; butter; brown sugar
""")

SITUATIONS = items("""
I just moved to a new city and I don't know anyone; My flatmate never does the dishes
I keep putting off a big project at work; My best friend forgot my birthday
I have two job offers and I can't decide between them; I want to ask for a raise but I'm nervous
My neighbour plays loud music late at night; I feel overwhelmed by my email inbox
I want to start exercising but I never stick with it; My teenager barely talks to me any more
I lent money to a friend and they haven't paid it back; I've been asked to give a speech at a wedding
I'm thinking about going back to university at thirty-five; My dog barks whenever I leave the house
I made a mistake at work that cost my team a day; I want to learn to code but I don't know which language to pick
My partner and I disagree about where to spend the holidays; I get nervous before every presentation
I have too many hobbies and no time for any of them; I can't fall asleep before two in the morning
I want to travel more but I'm on a tight budget; I've been invited to a party where I only know the host
My manager's feedback is always vague; I want to read more books this year
My kids argue about screen time every evening; I need to tell a client their project will be late
I want to volunteer but I don't know where to start; I'm moving in with my partner for the first time
A coworker keeps taking credit for my ideas; I feel stuck in my career; My old laptop has become very slow
I have a week off and no plans; I want to cook more instead of ordering takeaway
My parents live far away and I worry about them; I'm starting a new job on Monday
I want to write a novel but I never finish a chapter; I keep losing my keys
My small team has too many meetings; I've been offered a promotion that means managing my friends
""")

# --- explanations ---
CONCEPTS = items("""
inflation; compound interest; supply and demand; opportunity cost; machine learning; neural networks
how the internet works; public-key cryptography; blockchains; recursion; version control; relational databases
compilers; web APIs; cloud computing; natural selection; the immune response; herd immunity; climate feedback loops
the greenhouse effect; gravity; black holes; quantum computing; general relativity; entropy; probability
statistical significance; exponential growth; logarithms; derivatives in calculus; prime numbers; infinity
the Pythagorean theorem; democracy; the separation of powers; the stock market; interest rates; progressive taxation
insurance; supply chains; globalisation; the scientific method; randomised controlled trials; cognitive biases
confirmation bias; the sunk cost fallacy; game theory; the prisoner's dilemma; Stoicism; utilitarianism
existentialism; the social contract; object-oriented programming; hash tables; binary search; Big O notation
garbage collection; caching; HTTP; DNS; regular expressions; unit testing; static type systems; containers
virtual machines; open-source licences; operating systems; plate tectonics; photosynthesis; the water cycle
how vaccines work; how airplanes stay in the air; how a refrigerator keeps food cold; how GPS finds your location
how a bill becomes a law; how credit cards make money; how batteries store energy; why the sky is blue
why we have seasons; how memory works in the brain; how noise-cancelling headphones work; central banks
the placebo effect; the tragedy of the commons; comparative advantage; economies of scale; network effects
carbon footprints; renewable energy; the nitrogen cycle; the electromagnetic spectrum; the double-slit experiment
Moore's law; the Turing test; encryption; two-factor authentication; peer review; the Fibonacci sequence
the golden ratio; musical harmony; perspective in drawing; the rule of thirds in photography; supply-side economics
behavioural economics; the bystander effect; impostor syndrome; the Dunning-Kruger effect; circadian rhythms
the gut-brain connection; antibiotic resistance; gene editing with CRISPR; evolution by genetic drift
the Doppler effect; lift and drag; buoyancy; the laws of thermodynamics; continental drift; volcano formation
the tides; the phases of the Moon; dark energy; the expansion of the universe; how stars are born
how search engines rank pages; how a touchscreen senses a finger; how the heart pumps blood; how rainbows form
how an electric motor works; how bread rises; why ice floats; how noise travels through walls; how bees make honey
the difference between a mortgage's interest and principal; how elections are counted; how a jury trial works
the butterfly effect; the bell curve; sampling bias; the law of large numbers; the Monty Hall problem
how a neural network learns; how a spreadsheet formula works; how an index speeds up a database
how email gets delivered; how a password is stored safely; how a QR code stores data; version numbers in software
the immune system's memory; why we dream; how muscles grow; the food chain; biodiversity; erosion
""")

AUDIENCES = items("""
a ten-year-old; a high school student; a busy executive; my grandmother; someone who has never used a smartphone
a first-year university student; a curious five-year-old; someone who has just moved to this country
a software engineer from a different field; a history teacher; someone who is learning English
a complete beginner; a sceptical friend; a room full of nurses; a journalist writing a short article
a small business owner; an expert who wants a quick refresher; a retired engineer; a group of teenagers
""")

COMPARISONS = items("""
weather vs climate; a virus vs a bacterium; stocks vs bonds; Python lists vs tuples; TCP vs UDP; RAM vs storage
a simile vs a metaphor; baking soda vs baking powder; an alligator vs a crocodile; speed vs velocity
mass vs weight; a democracy vs a republic; renting vs buying a home; a debit card vs a credit card
empathy vs sympathy; machine learning vs traditional programming; a latte vs a cappuccino; mitosis vs meiosis
an epidemic vs a pandemic; a hurricane vs a tornado; HTTP vs HTTPS; a compiler vs an interpreter
SQL vs NoSQL databases; a process vs a thread; git merge vs git rebase; the mean vs the median
correlation vs causation; weightlifting vs cardio; a comet vs an asteroid; a star vs a planet
nuclear fission vs nuclear fusion; DNA vs RNA; socialism vs communism; Impressionism vs Expressionism
baroque vs classical music; a novel vs a novella; a frog vs a toad; a rabbit vs a hare; a moth vs a butterfly
Stoicism vs Epicureanism; ethics vs morals; inflation vs deflation; a recession vs a depression
a loan vs a line of credit; a will vs a trust; LED vs incandescent bulbs; AC vs DC electricity
a heat pump vs a gas boiler; electric vs hybrid cars; tea vs coffee; yoga vs pilates; e-books vs printed books
a laptop vs a desktop computer; Wi-Fi vs mobile data; a router vs a modem; static vs dynamic typing
unit tests vs integration tests; a stack vs a queue; an array vs a linked list; recursion vs iteration
a class vs an object; an abstract class vs an interface; concurrency vs parallelism
symmetric vs asymmetric encryption; authentication vs authorisation; a library vs a framework
a solar eclipse vs a lunar eclipse; a lake vs a pond; a hill vs a mountain; a sea vs an ocean
a psychologist vs a psychiatrist; an invoice vs a receipt; a résumé vs a CV; a sprint vs a marathon
""")

DECISIONS = items("""
working from home; electric cars; renting instead of buying a home; nuclear power; raising children bilingual
a four-day working week; social media for teenagers; homeschooling; living in a big city; open-plan offices
studying abroad; buying a used car; freelancing; a gap year before university; getting a dog
solar panels on a family home; online dating; self-publishing a book; intermittent fasting; standing desks
a minimalist lifestyle; a cashless society; smart home devices; remote learning; living in a tiny house
buying groceries in bulk; using a credit card for everyday purchases; shared e-scooters in cities
starting a business in your twenties; living with flatmates; a gym membership; early retirement
a variable-rate mortgage; having a side job; moving to the countryside; a vegetarian diet
open-source software for a small company; microservices; test-driven development; pair programming
a monorepo; learning to code as an adult; school uniforms; year-round schooling; tourism in small villages
daylight saving time; self-checkout machines; electric scooters; public libraries going digital
banning cars from city centres; universal basic income; coworking spaces; keeping chickens in the garden
""")

# --- writing ---
TONES = items("formal; friendly; polite but firm; enthusiastic; concise; warm; professional; light-hearted")
SPEECH_TONES = items("warm; funny; heartfelt; short and sweet; formal; light-hearted; moving")
PRODUCT_TONES = items("playful; premium; friendly; minimalist; enthusiastic; witty; no-nonsense")

EMAILS = items("""
to my landlord asking them to repair a leaking tap; to a colleague asking to move our meeting to next week
to a customer apologising for a delayed order; to my manager requesting two days off
to a professor asking for an extension on an essay; to a neighbour about a parcel delivered to me by mistake
to a hotel asking about early check-in; to my team announcing a new weekly check-in meeting
to a friend I haven't spoken to in years; to a recruiter declining a job offer; to a supplier about a billing error
to parents about an upcoming school trip; to a gym cancelling my membership
to a conference organiser proposing a talk; to a new client welcoming them on board
to my team thanking them after a product launch; to my landlord giving notice that I'm moving out
to a former mentor asking for career advice; to the local council reporting a broken streetlight
to volunteers about a change of venue; to an author telling them how much I enjoyed their book
to an airline asking for a refund for a cancelled flight; to a colleague handing over my work before a holiday
to my bank disputing a card payment; to a restaurant booking a table for a large group
to a plumber asking for a quote; to a former teacher to thank them; to my team about a missed deadline
to an interviewer following up after an interview
""")

CHARACTERS = items("""
a retired lighthouse keeper; a shy robot; a girl with a gift for talking to birds; an elderly librarian; a young chef
a stray cat; a time traveller from 1850; a tired delivery driver; a dragon with a fear of heights
a lonely astronaut; a village postman; a coffee-hating detective; a teenage inventor
a grandmother learning to skateboard; an absent-minded wizard; a very old tortoise; a substitute teacher
a ship's cook; a museum night guard; a sheep farmer; a ghost in an old theatre; a small-town mayor
a nervous magician; an octopus in an aquarium; a street musician; a retired footballer; a knight with no sword
a boy with a collection of old keys; a new kid at school; a beekeeper; a mountain guide; an old clockmaker
a forgetful giant; a city pigeon; a lost tourist; a late-night radio host
""")

PLOTS = items("""
finds a map hidden in a library book; has to cross the city during a blackout
wakes up able to hear what plants are thinking; receives a letter addressed to someone from a century ago
must win a baking contest to save a shop; discovers a door that wasn't there yesterday
befriends the neighbour everyone avoids; gets stuck in a lift with a stranger
loses an important key the night before a big event; tries to return a lost wallet
accidentally becomes famous online; has one day to fix a broken clock tower; gets lost on a mountain in thick fog
finds a message in a bottle; is the last person awake on a long night train
has to teach a class about something they know nothing about; inherits a mysterious greenhouse
swaps lives with a neighbour for a week; hears a song that nobody else can hear
must deliver a parcel to the other side of the world; tries to keep a secret from a whole village
finds a talking fox in the garden; builds a boat out of junk; follows footprints in fresh snow
opens a café on the Moon; must find a missing festival lantern; plants a seed that grows overnight
loses their voice before a big performance; gets the same phone call every night at midnight
""")

GENRES = items("mystery; science fiction; fantasy; comic; adventure; ghost; fairy-tale; detective; slice-of-life")

STORY_LENGTHS = items("short; very short; 200-word; 500-word; two-paragraph; one-page")

POEM_FORMS = items("""
haiku; limerick; sonnet; free-verse poem; short rhyming poem for children; four-stanza poem
poem of exactly eight lines; ode; poem in rhyming couplets
""")

POEM_SUBJECTS = items("""
the first snow of winter; a city at night; an old pair of boots; morning coffee; a thunderstorm
my grandmother's kitchen; the last day of summer; a lighthouse; moving to a new home; a cat asleep in the sun
the sound of rain on a roof; a long train journey; friendship; a forgotten garden; the ocean at dawn
learning to ride a bike; autumn leaves; a busy market; the Moon; homesickness; a quiet library
an old photograph; bread baking in the oven; the night sky in the desert; a kite; a slow river
the first day of school; a melting snowman; a lost umbrella; hope; a mountain summit; fireflies
a quiet Sunday morning; the smell of rain; a violin; a lemon tree; waiting for a letter; a bus stop in the rain
a spider's web; an empty playground; a candle; a paper boat; the passing of time; a honeybee
fog over a harbour; a birthday; a friend who lives far away; the wind; an old stone bridge; a field of sunflowers
""")

MOODS = items("joyful; melancholy; playful; reflective; hopeful; nostalgic; calm; humorous")

PRODUCTS = items("""
a stainless steel water bottle; noise-cancelling headphones; a handmade ceramic mug; a folding electric bike
a bamboo toothbrush; a smart thermostat; a waterproof hiking jacket; a cast iron frying pan
an ergonomic office chair; a children's picture book about dinosaurs; a scented soy candle
a compact espresso machine; a cork yoga mat; a wireless phone charger; a solar-powered garden light
a leather-bound notebook; a board game for families; a reusable shopping bag; a robot vacuum cleaner
a set of watercolour paints; a GPS tracker for pets; a weighted blanket; a mechanical keyboard; a camping stove
a kick scooter for children; an electric toothbrush; a herbal tea sampler; a digital kitchen scale
a pair of trail running shoes; a portable projector; a houseplant subscription; a language-learning app
a wool winter hat; an air purifier; a chef's knife; a carry-on travel backpack; a baby monitor; a cordless drill
""")

BUYERS = items("""
busy parents; students; outdoor enthusiasts; home cooks; first-time home owners; gift shoppers
eco-conscious shoppers; gamers; older adults; small business owners; frequent travellers
""")

CHANNELS = items("""
for an online shop; for a social media advert; for a printed catalogue; for a crowdfunding page
for the back of the box
""")

JOBS = items("""
junior data analyst; primary school teacher; barista; museum guide; customer service representative
graphic designer; warehouse supervisor; junior web developer; veterinary nurse; hotel receptionist
marketing assistant; park ranger; library assistant; sales associate; lab technician; event coordinator
social media manager; bookkeeper; chef de partie; IT support technician
""")

BACKGROUNDS = items("""
is changing careers after ten years in retail; has just graduated; is returning to work after raising children
has lots of volunteer experience but little paid work; has moved from another country
has worked in a similar role for three years
""")

OCCASIONS = items("""
my sister's wedding; a colleague's retirement party; a school graduation; the opening of a community garden
my parents' fortieth wedding anniversary; a friend's farewell party; the launch of a small business
a charity fundraising dinner; the end of a football season; a new year's team meeting
my grandfather's ninetieth birthday; a welcome event for new students
""")

# --- code: verb phrases ("a function that ..."), chosen to stay clear of HumanEval's tasks ---
CODE_TASKS = items("""
checks whether a year is a leap year; counts how often each word appears in a text file
merges two sorted lists into one sorted list; removes duplicate lines from a file but keeps their order
converts a Roman numeral to an integer; checks that an email address looks valid using a regular expression
flattens an arbitrarily nested list; computes a moving average over a list of numbers
reads a CSV file and returns the average of one column; generates a random password of a given length
splits a list into chunks of a given size; finds all files with a given extension under a directory
retries a failing call with exponential backoff; formats a number of seconds as hours, minutes and seconds
fetches a URL and parses the JSON response; implements binary search on a sorted list
implements a stack with push, pop and peek; implements a least-recently-used cache
loads a JSON config file and fills in default values; transposes a matrix given as a list of lists
rotates a list by k positions; groups a list of records by the value of one field
computes the Levenshtein distance between two strings; finds the day of the week for a date
counts the lines of code in a project, skipping comments and blank lines; adds a date prefix to every file in a folder
finds the longest common prefix of a list of strings; merges two dictionaries, adding up values for shared keys
implements a queue with two stacks; serialises a binary tree to a string and back; implements a trie for word lookup
checks whether a Sudoku board is valid; simulates rolling two dice many times and prints the distribution
flattens a nested dictionary into one with dotted keys; measures how long another function takes to run
caches a function's results; limits how often a function can be called; computes the SHA-256 hash of a large file
finds the k most common elements in a list; generates the first n rows of Pascal's triangle
detects a cycle in a linked list; evaluates an arithmetic expression given as a string
converts an integer into English words; masks all but the last four digits of a card number
wraps long text to a given line width; strips HTML tags from a string; extracts all URLs from a block of text
counts the working days between two dates; runs tasks in order of priority using a heap
models a bank account with deposits, withdrawals and an overdraft limit; simulates a traffic light as a state machine
prints a text histogram of a list of numbers; compresses a string with run-length encoding
picks a random item according to given weights; writes a list of records to a CSV file
finds duplicate files in a folder by comparing their contents; computes the Jaccard similarity of two sets
converts CamelCase names to snake_case; parses a URL query string into a dictionary
checks whether a string is a valid IPv4 address; multiplies two matrices without any libraries
counts the islands in a grid of zeros and ones; finds the shortest path through a maze given as a grid
downloads several web pages concurrently; watches a folder and reports new files
""")
LANGUAGES = items("Python; Python; Python; Python; Python; JavaScript; TypeScript; Go; Rust; Java; C#; Ruby; C++")
