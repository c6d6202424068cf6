"""Held-out text for `make eval`, written for this project (never downloaded): paragraphs for perplexity, and
instructions whose greedy answers are compared across engine configurations and scored by the reference model."""

PARAGRAPHS = [
    "The lighthouse at the end of the harbour has not been staffed for thirty years. Its lamp still turns every night, "
    "driven by a small motor that a volunteer checks on Sundays.",
    "Bread rises because yeast eats the sugars in flour and releases carbon dioxide. The gas is trapped by a network "
    "of gluten, which stretches like a balloon as the dough proofs.",
    "When the river froze in January, the children of the village skated from one bridge to the next. Their parents "
    "watched from the bank, drinking tea from a shared flask.",
    "A spreadsheet is a grid of cells, each holding a number, a piece of text or a formula. When one value changes, "
    "every formula that depends on it is recomputed.",
    "The museum's newest exhibit is a collection of maps drawn before the coastline was surveyed. Some islands appear "
    "twice, and one bay is drawn three times its real size.",
    "Tomatoes grow best in full sun with regular watering. Too much water at once can split the fruit, while too "
    "little makes the leaves curl and the plants stop flowering.",
    "The train was late again, so Maria read another chapter of her book on the platform. By the time it arrived, "
    "the detective had found the missing letter in the piano.",
    "A compiler translates source code into instructions a machine can execute. Along the way it checks types, "
    "removes code that can never run and arranges loops to use the cache well.",
    "Every autumn the geese fly south in long, uneven lines. They take turns at the front, where the air resistance "
    "is greatest, and rest behind the others when they tire.",
    "The recipe called for two eggs, a cup of milk and a pinch of salt. Tom doubled everything except the salt, "
    "which he forgot, and the pancakes still disappeared within minutes.",
    "Solar panels convert sunlight into electricity using layers of silicon. Their output drops on cloudy days and "
    "when the panels are covered in dust, so owners clean them a few times a year.",
    "The old library smelled of paper and floor polish. Students whispered between the shelves, and the clock above "
    "the door ticked loudly in the afternoon silence.",
    "A good password is long and hard to guess. Many people now use a password manager, which remembers a different "
    "random password for every website they visit.",
    "The volcano last erupted in the spring of 1971, covering the eastern slopes in ash. Today those slopes are green "
    "again, and farmers grow grapes in the dark, fertile soil.",
    "Our team meets every Monday to plan the week. Each person says what they finished, what they will work on next "
    "and whether anything is blocking them.",
    "Octopuses can change the colour and texture of their skin in a fraction of a second. They use this to hide from "
    "predators, to surprise prey and possibly to signal to one another.",
    "The bakery on the corner opens at six in the morning. By seven there is a queue outside, and by nine the "
    "croissants are usually gone.",
    "A database index works like the index at the back of a book. Instead of reading every page, the system looks up "
    "the value and jumps straight to the rows that contain it.",
    "The marathon route passes through four neighbourhoods and crosses the river twice. Volunteers hand out water "
    "every five kilometres, and a band plays at the halfway point.",
    "In the desert, temperatures can fall below freezing at night even after a scorching day. Dry air and clear skies "
    "let the heat escape quickly once the sun goes down.",
    "She planted an apple tree the year her daughter was born. Twenty years later, they picked the fruit together and "
    "made a pie from their grandmother's recipe.",
    "Batteries store energy in chemical form and release it as an electric current. Over hundreds of charge cycles "
    "their capacity slowly shrinks, which is why old phones need charging more often.",
    "The orchestra tuned their instruments while the audience found their seats. Then the lights dimmed, the "
    "conductor raised her baton, and the hall fell silent.",
    "Bees communicate the location of flowers through a dance. The angle of the dance shows the direction relative "
    "to the sun, and its length tells the others how far to fly.",
    "The city council voted to close the main street to cars on Saturdays. Shop owners were worried at first, but "
    "the number of visitors has grown every month since.",
    "A map projection turns the curved surface of the earth into a flat picture. Every projection distorts something: "
    "areas, angles, distances or the shapes of the continents.",
    "The kitten slept in a cardboard box by the radiator all afternoon. When the door opened, she leapt out, chased "
    "her own tail twice and went straight back to sleep.",
    "Wind turbines turn fastest on open hills and along the coast. Their long blades are designed to catch even light "
    "winds, and the largest can power thousands of homes.",
    "The hikers reached the summit just before noon. Clouds drifted below them, and in the distance they could see "
    "the lake where they had camped the night before.",
    "Caching keeps a copy of data close to where it is needed. A web browser caches images so that returning to a "
    "page does not mean downloading them all again.",
    "The farmer checks the weather forecast every evening during the harvest. A single day of heavy rain can flatten "
    "a field of wheat that took months to grow.",
    "Learning a language takes patience. Most people understand far more than they can say at first, and speaking "
    "comes only after months of listening and reading.",
    "The ferry crosses the strait six times a day in summer and twice a day in winter. On stormy days it does not "
    "sail at all, and the island is cut off until the wind drops.",
    "A thermostat measures the temperature of a room and switches the heating on or off to keep it near the chosen "
    "value. Newer models learn when the house is usually empty.",
    "The painter worked on the portrait for three years. She repainted the hands eleven times before she was "
    "satisfied that they looked as though they could move.",
    "Coral reefs cover a tiny fraction of the ocean floor but shelter about a quarter of all marine species. Warmer "
    "water causes corals to expel the algae that feed them.",
    "The school's robotics club built a machine that sorts coloured blocks. It uses a camera to see each block and a "
    "small arm to drop it into the right bin.",
    "Rain had fallen all night, and the streets shone under the lamps. A single taxi waited at the rank, its driver "
    "asleep with the radio playing softly.",
    "Version control records every change to a project's files. If a change breaks something, the team can compare "
    "versions, find the mistake and return to a working state.",
    "The tortoise in the zoo is over a hundred years old. Keepers weigh him every month and feed him lettuce, "
    "dandelions and, on his birthday, a slice of melon.",
]

INSTRUCTIONS = [
    "Explain in two sentences why the sky is blue.",
    "Give three tips for sleeping better.",
    "Write a short poem about the sea.",
    "What is the capital of Japan?",
    "Describe how to make a cup of tea.",
    "List four fruits that are red.",
    "Why do we have seasons?",
    "Write a friendly email inviting a colleague to lunch.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "Explain what a computer program is to a child.",
    "How many legs does a spider have?",
    "Write one sentence about autumn.",
    "What are the three primary colours?",
    "Give a short definition of photosynthesis.",
    "Describe a busy market in the morning.",
    "What should I pack for a weekend hike?",
    "Explain why exercise is good for health.",
    "Write a short story opening about a lost key.",
    "What is the boiling point of water at sea level?",
    "Summarise the plot of Little Red Riding Hood.",
    "Give two reasons to learn a second language.",
    "What does a librarian do?",
    "Describe the taste of a lemon.",
    "Write a haiku about snow.",
    "How do plants get water?",
    "Name three planets in our solar system.",
    "Explain what recycling means.",
    "What is a good way to start learning to cook?",
    "Write a thank-you note to a teacher.",
    "Why is it important to drink water?",
    "Describe a cat in three sentences.",
    "What is the largest ocean on Earth?",
    "Give advice to someone starting a new job.",
    "Explain how a bicycle works.",
    "What is a rainbow made of?",
    "Write a short description of a city at night.",
    "List three things that make a good friend.",
    "How does a refrigerator keep food cold?",
    "What is the difference between a lake and a river?",
]
